"""KV cache specs: sizes, states, block-size helpers and validation."""

from __future__ import annotations

from fractions import Fraction

import attrs
import pytest
import torch

from kvcore.memory.planner import plan_kv_cache
from kvcore.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def test_full_attention_page():
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    assert spec.head_size_v == 32
    assert spec.num_heads == 4
    assert spec.num_states == 16
    assert spec.state_content_size_bytes == (32 + 32) * 2
    assert spec.page_size_bytes == 4 * 16 * 128
    assert spec.real_page_size_bytes == spec.page_size_bytes
    assert spec.view_dtype is torch.float16
    assert spec.has_layer_views is True


def test_head_size_v_and_slots():
    spec = FullAttentionSpec(8, 2, 64, torch.bfloat16, head_size_v=32, num_head_slots=3)
    assert spec.num_heads == 3
    assert spec.state_content_size_bytes == (64 + 32) * 2
    assert spec.page_size_bytes == 3 * 8 * 192
    # head_size_v=None means equal to head_size, also for equality.
    assert FullAttentionSpec(8, 2, 64, torch.bfloat16) == FullAttentionSpec(
        8, 2, 64, torch.bfloat16, head_size_v=64
    )


def test_state_content_bytes_override():
    # fp8 K/V with scales: 2*64 bytes + 8 bytes of scales per (head, token)
    spec = FullAttentionSpec(16, 2, 64, torch.uint8, state_content_bytes=136)
    assert spec.state_content_size_bytes == 136
    assert spec.page_size_bytes == 2 * 16 * 136


def test_mla_has_no_separate_v():
    spec = MLAAttentionSpec(16, 1, 576, torch.bfloat16)
    assert spec.head_size_v == 0
    assert spec.state_content_size_bytes == 576 * 2
    assert spec.page_size_bytes == 16 * 1152
    assert isinstance(spec, FullAttentionSpec)


def test_compressed_tokens_per_state():
    spec = MLAAttentionSpec(256, 1, 16, torch.bfloat16, tokens_per_state=4)
    assert spec.num_states == 64
    assert spec.page_size_bytes == 64 * 32
    assert spec.get_num_kernel_states(64) == 16
    assert spec.get_num_kernel_states(256) == 64
    with pytest.raises(ValueError, match="block size 6 .*tokens_per_state=4.*divisible by 4"):
        spec.get_num_kernel_states(6)
    with pytest.raises(ValueError, match="block size 10 "):
        MLAAttentionSpec(10, 1, 16, torch.bfloat16, tokens_per_state=4)


def test_fractional_tokens_per_state():
    spec = FullAttentionSpec(4, 1, 8, torch.float32, tokens_per_state=Fraction(1, 3))
    assert spec.num_states == 12
    assert spec.get_num_kernel_states(1) == 3
    assert spec.page_size_bytes == 12 * 64
    # 3 states every 2 tokens: odd kernel blocks do not hold whole states.
    spec = FullAttentionSpec(4, 1, 8, torch.float32, tokens_per_state=Fraction(2, 3))
    assert spec.get_num_kernel_states(2) == 3
    with pytest.raises(ValueError, match="block size 1 "):
        spec.get_num_kernel_states(1)
    # An integral Fraction is an int.
    spec = FullAttentionSpec(8, 1, 8, torch.float32, tokens_per_state=Fraction(4, 1))
    assert spec.tokens_per_state == 4 and type(spec.tokens_per_state) is int


@pytest.mark.parametrize("tps", [0, -1, -7])
def test_non_positive_tokens_per_state_is_one_state(tps):
    spec = FullAttentionSpec(13, 2, 8, torch.float16, tokens_per_state=tps)
    assert spec.num_states == 1
    assert spec.get_num_kernel_states(13) == 1
    assert spec.page_size_bytes == 2 * 32


@pytest.mark.parametrize("tps", [Fraction(3, 2), Fraction(-1, 2), Fraction(5, 4)])
def test_fraction_outside_unit_interval_refused(tps):
    with pytest.raises(ValueError, match=f"tokens_per_state={tps}"):
        FullAttentionSpec(12, 1, 8, torch.float16, tokens_per_state=tps)


@pytest.mark.parametrize("tps", [1.5, 2.0, "2", True])
def test_tokens_per_state_type(tps):
    with pytest.raises(TypeError, match="tokens_per_state.*" + str(tps).replace(".", r"\.")):
        FullAttentionSpec(12, 1, 8, torch.float16, tokens_per_state=tps)


def test_copy_with_new_block_size():
    spec = SlidingWindowSpec(
        32, 2, 16, torch.float16, sliding_window=128, block_stride_alignment=MultipleOf(16)
    )
    small = spec.copy_with_new_block_size(16)
    assert type(small) is SlidingWindowSpec
    assert small.block_size == 16 and spec.block_size == 32
    assert attrs.evolve(small, block_size=32) == spec
    assert small.page_size_bytes == spec.page_size_bytes // 2
    with pytest.raises(ValueError, match="block_size.*0"):
        spec.copy_with_new_block_size(0)
    mla = MLAAttentionSpec(256, 1, 16, torch.bfloat16, tokens_per_state=4)
    assert mla.copy_with_new_block_size(64).num_states == 16
    with pytest.raises(ValueError, match="block size 6 "):
        mla.copy_with_new_block_size(6)


@pytest.mark.parametrize("max_len, blocks", [(1, 1), (16, 1), (17, 2), (1000, 63), (1008, 63)])
def test_max_num_blocks_per_req(max_len, blocks):
    assert FullAttentionSpec(16, 1, 8, torch.float16).max_num_blocks_per_req(max_len) == blocks


def test_max_num_blocks_per_req_bad():
    with pytest.raises(ValueError, match="max_model_len.*0"):
        FullAttentionSpec(16, 1, 8, torch.float16).max_num_blocks_per_req(0)


def test_block_stride_alignment():
    plain = FullAttentionSpec(48, 2, 8, torch.float16)
    assert plain.get_block_stride_alignment() == 1
    # Kernel block equals the block (or is a multiple of it): 1.
    assert attrs.evolve(plain, block_stride_alignment=MultipleOf(48)).get_block_stride_alignment() == 1
    assert attrs.evolve(plain, block_stride_alignment=MultipleOf(96)).get_block_stride_alignment() == 1
    # gcd(64, 48) = 16 tokens: 2 heads * 16 states * 32 bytes.
    spec = attrs.evolve(plain, block_stride_alignment=MultipleOf(64))
    assert spec.get_block_stride_alignment() == 2 * 16 * 32
    # gcd(16, 48) = 16 as well; gcd(5, 48) = 1 token.
    assert attrs.evolve(plain, block_stride_alignment=MultipleOf(16)).get_block_stride_alignment() == 1024
    assert attrs.evolve(plain, block_stride_alignment=MultipleOf(5)).get_block_stride_alignment() == 64
    # Compressed: gcd(64, 256) = 64 tokens = 16 states of 32 bytes.
    mla = MLAAttentionSpec(
        256, 1, 16, torch.bfloat16, tokens_per_state=4, block_stride_alignment=MultipleOf(64)
    )
    assert mla.get_block_stride_alignment() == 16 * 32


def test_multiple_of():
    m = MultipleOf(16)
    assert m.accepts(16) and m.accepts(48) and not m.accepts(8) and not m.accepts(24)
    assert MultipleOf(16) == MultipleOf(16) and hash(MultipleOf(4)) == hash(MultipleOf(4))
    with pytest.raises(ValueError, match="base.*0"):
        MultipleOf(0)
    with pytest.raises(TypeError, match="base.*'16'"):
        MultipleOf("16")
    with pytest.raises(TypeError, match="block_stride_alignment.*16"):
        FullAttentionSpec(16, 1, 8, torch.float16, block_stride_alignment=16)


def test_other_attention_specs():
    chunked = ChunkedLocalAttentionSpec(16, 2, 8, torch.float16, attention_chunk_size=64)
    assert chunked.attention_chunk_size == 64 and chunked.page_size_bytes == 2 * 16 * 32
    for cls in (EncoderOnlyAttentionSpec, CrossAttentionSpec):
        spec = cls(16, 2, 8, torch.float16)
        assert isinstance(spec, AttentionSpec) and spec.page_size_bytes == 1024
    full = FullAttentionSpec(16, 2, 8, torch.float16, sliding_window=128)
    assert full.sliding_window == 128 and full.attention_chunk_size is None
    with pytest.raises(TypeError):
        SlidingWindowSpec(16, 2, 8, torch.float16)  # sliding_window is required
    with pytest.raises(ValueError, match="sliding_window.*-4"):
        SlidingWindowSpec(16, 2, 8, torch.float16, sliding_window=-4)


def test_padded_attention_page():
    spec = FullAttentionSpec(8, 1, 8, torch.float16, page_size_padded=384)
    assert spec.page_size_bytes == 384 and spec.real_page_size_bytes == 256
    with pytest.raises(ValueError, match="page_size_padded=200.*256"):
        FullAttentionSpec(8, 1, 8, torch.float16, page_size_padded=200)


def test_padded_page_must_hold_whole_elements():
    # regression (#14): a 2050-byte float32 page was accepted, and no layout could allocate it
    with pytest.raises(ValueError, match=r"page_size_padded=2050 is not a multiple of the 4-byte torch.float32.*2052"):
        FullAttentionSpec(16, 2, 8, torch.float32, page_size_padded=2050)
    assert FullAttentionSpec(16, 2, 8, torch.float32, page_size_padded=2052).page_size_bytes == 2052
    with pytest.raises(ValueError, match=r"page_size_padded=14 is not a multiple of 4 bytes.*16"):
        MambaSpec(16, [(1,), (3,)], [torch.float32, torch.float16], page_size_padded=14)
    assert MambaSpec(16, [(3,)], [torch.float16], page_size_padded=14).page_size_bytes == 14


def test_dtype_alignment_is_the_largest_element():
    assert FullAttentionSpec(16, 2, 8, torch.bfloat16).dtype_alignment == 2
    mixed = MambaSpec(16, [(3,), (1,)], [torch.float16, torch.float32])
    assert mixed.view_dtype is torch.int8 and mixed.dtype_alignment == 4
    group = UniformTypeKVCacheSpecs(16, {"a": MambaSpec(16, [(3,)], [torch.int8]), "b": mixed})
    assert group.dtype_alignment == 4


@pytest.mark.parametrize("heads", [0, 2, 8])
def test_mla_has_one_latent_vector_per_token(heads):
    # regression (#15): MLAAttentionSpec(num_kv_heads=2) was accepted
    with pytest.raises(ValueError, match=f"num_kv_heads.*{heads}"):
        MLAAttentionSpec(16, heads, 576, torch.bfloat16)
    if heads:
        with pytest.raises(ValueError, match="one latent vector per token.*num_kv_heads must be 1"):
            MLAAttentionSpec(16, heads, 576, torch.bfloat16)
    spec = MLAAttentionSpec(16, 1, 576, torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        attrs.evolve(spec, num_kv_heads=heads or 3)


def test_mamba_spec():
    spec = MambaSpec(16, [(3, 4), (2, 8)], [torch.float32, torch.float32])
    assert spec.state_bytes == (48, 64)
    assert spec.page_size_bytes == 112 == spec.real_page_size_bytes
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (1, 1, 112)
    assert spec.tokens_per_state == -1
    assert spec.view_dtype is torch.float32
    assert spec.max_num_blocks_per_req(10_000) == 1
    assert spec.copy_with_new_block_size(64).page_size_bytes == 112
    padded = MambaSpec(16, [(3, 4), (2, 8)], [torch.float32] * 2, page_size_padded=128)
    assert MambaSpec(16, [(3, 4)], torch.float32).dtypes == (torch.float32,)
    assert padded.page_size_bytes == 128 and padded.real_page_size_bytes == 112
    mixed = MambaSpec(16, [(2, 4), (6,)], [torch.float32, torch.bfloat16])
    assert mixed.view_dtype is torch.int8
    assert mixed.page_size_bytes == 32 + 12


def test_mamba_split_states():
    spec = MambaSpec(16, [(2, 3), (5,), ()], [torch.float32, torch.float16, torch.float16])
    # page: 24 + 10 + 2 = 36 bytes, padded to 40; 3 blocks
    padded = attrs.evolve(spec, page_size_padded=40)
    raw = torch.randint(-128, 128, (3 * 40,), dtype=torch.int8)
    view = raw.as_strided((3, 1, 1, 36), (40, 36, 36, 1))
    ssm, conv, scalar = padded.split_states(view)
    assert ssm.shape == (3, 2, 3) and ssm.dtype is torch.float32
    assert conv.shape == (3, 5) and conv.dtype is torch.float16
    assert scalar.shape == (3,) and scalar.dtype is torch.float16
    for b in range(3):
        page = raw[b * 40 : b * 40 + 36]
        assert torch.equal(ssm[b].flatten().view(torch.int8), page[:24])
        assert torch.equal(conv[b].view(torch.int8), page[24:34])
        assert scalar[b].view(torch.int16) == page[34:36].view(torch.int16)[0]
    # A write through a state lands in the page.
    ssm[1, 1, 2] = 7.5
    assert raw[40 + 20 : 40 + 24].view(torch.float32).item() == 7.5


def test_mamba_split_states_misaligned():
    spec = MambaSpec(16, [(3,), (2,)], [torch.int8, torch.float32])
    view = torch.zeros(2 * 11, dtype=torch.int8).view(2, 1, 1, 11)
    with pytest.raises(ValueError, match="state 1 .*float32.*byte 3.*decreasing element size"):
        spec.split_states(view)
    with pytest.raises(ValueError, match=r"\[B, 1, 1, C\].*\(2, 11\)"):
        spec.split_states(view[:, 0, 0])


@pytest.mark.parametrize(
    "args, kwargs, exc, text",
    [
        (([(2, 0)], [torch.float16]), {}, ValueError, r"\(2, 0\)"),
        (([(2, 3)], [torch.float16, torch.float16]), {}, ValueError, "1 shapes and 2 dtypes"),
        (([(2, 3), (4,)], torch.float16), {}, ValueError, "2 shapes and 1 dtypes"),
        (([], []), {}, ValueError, "0 shapes"),
        (([(2, 3)], ["float16"]), {}, TypeError, "'float16'"),
        (([(2.5, 3)],), {"dtypes": torch.float16}, TypeError, "2.5"),
        (([7],), {"dtypes": torch.float16}, TypeError, r"\[7\]"),
        ((5, torch.float16), {}, TypeError, "shapes.*5"),
        (([(2, 3)], [torch.float16]), {"page_size_padded": 8}, ValueError, "page_size_padded=8.*12"),
    ],
)
def test_mamba_bad_input(args, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        MambaSpec(16, *args, **kwargs)


def test_uniform_type_specs():
    a = FullAttentionSpec(16, 4, 32, torch.float16)
    b = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    group = UniformTypeKVCacheSpecs(16, {"l0": a, "l1": b})
    assert group.page_size_bytes == a.page_size_bytes + b.page_size_bytes
    assert group.real_page_size_bytes == group.page_size_bytes
    assert group.tokens_per_state == 1
    assert group.max_num_blocks_per_req(33) == 3
    small = group.copy_with_new_block_size(8)
    assert small.block_size == 8
    assert small.kv_cache_specs["l1"] == b.copy_with_new_block_size(8)
    assert UniformTypeKVCacheSpecs.is_uniform_type({"l0": a, "l1": b})
    assert UniformTypeKVCacheSpecs.from_specs({"l0": a, "l1": b}) == group
    mla = MLAAttentionSpec(16, 1, 64, torch.float16)
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"l0": a, "l1": mla})
    assert UniformTypeKVCacheSpecs.from_specs({"l0": a, "l1": mla}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"l0": a, "l1": a.copy_with_new_block_size(8)}) is None
    # Windows must match too: layers of one group share one attention window.
    w1 = SlidingWindowSpec(16, 4, 32, torch.float16, sliding_window=64)
    w2 = SlidingWindowSpec(16, 2, 32, torch.float16, sliding_window=128)
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"l0": w1, "l1": w2})
    assert UniformTypeKVCacheSpecs.from_specs({"l0": w1, "l1": attrs.evolve(w2, sliding_window=64)})
    # Alignment of the union: sum of each layer's 8-token page.
    aligned = attrs.evolve(group, block_stride_alignment=MultipleOf(8))
    assert aligned.get_block_stride_alignment() == (a.page_size_bytes + b.page_size_bytes) // 2


def test_uniform_type_specs_bad_input():
    a = FullAttentionSpec(16, 4, 32, torch.float16)
    with pytest.raises(ValueError, match="at least one"):
        UniformTypeKVCacheSpecs(16, {})
    with pytest.raises(ValueError, match="FullAttentionSpec, MLAAttentionSpec"):
        UniformTypeKVCacheSpecs(16, {"a": a, "b": MLAAttentionSpec(16, 1, 64, torch.float16)})
    with pytest.raises(ValueError, match="'b' has block size 8.*16"):
        UniformTypeKVCacheSpecs(16, {"a": a, "b": a.copy_with_new_block_size(8)})
    with pytest.raises(ValueError, match="one spec type, got FullAttentionSpec, MLAAttentionSpec"):
        UniformTypeKVCacheSpecs(16, {"a": a, "b": MLAAttentionSpec(8, 1, 64, torch.float16)})
    with pytest.raises(TypeError, match="'b' maps to 3"):
        UniformTypeKVCacheSpecs(16, {"a": a, "b": 3})
    with pytest.raises(TypeError, match=r"map layer names.*\[1, 2\]"):
        UniformTypeKVCacheSpecs(16, [1, 2])


class RawSpec(KVCacheSpec):
    """A spec that lays out its own raw page."""

    @property
    def page_size_bytes(self) -> int:
        return 100


def test_base_spec_is_one_raw_page_per_block():
    spec = RawSpec(16)
    assert (spec.num_heads, spec.num_states, spec.state_content_size_bytes) == (1, 1, 100)
    assert spec.real_page_size_bytes == 100
    assert spec.view_dtype is torch.int8
    assert spec.max_num_blocks_per_req(17) == 2
    with pytest.raises(NotImplementedError, match="KVCacheSpec"):
        _ = KVCacheSpec(16).page_size_bytes


@pytest.mark.parametrize(
    "args, kwargs, exc, text",
    [
        ((0, 1, 8, torch.float16), {}, ValueError, "block_size.*0"),
        ((-16, 1, 8, torch.float16), {}, ValueError, "block_size.*-16"),
        ((16, 0, 8, torch.float16), {}, ValueError, "num_kv_heads.*0"),
        ((16, 1, -8, torch.float16), {}, ValueError, "head_size.*-8"),
        ((16, 1, 8, "float16"), {}, TypeError, "dtype.*'float16'"),
        ((16, 1, 8, torch.float16), {"head_size_v": -1}, ValueError, "head_size_v.*-1"),
        ((16, 1, 8, torch.float16), {"num_head_slots": 0}, ValueError, "num_head_slots.*0"),
        ((16, 1, 8, torch.float16), {"page_size_padded": 0}, ValueError, "page_size_padded.*0"),
        ((16, 1, 8, torch.float16), {"state_content_bytes": 0}, ValueError, "state_content_bytes.*0"),
        ((16, 1, 8, torch.float16), {"state_content_bytes": 33}, ValueError, "33 content bytes.*2-byte"),
        ((16.0, 1, 8, torch.float16), {}, TypeError, "block_size.*16.0"),
        ((16, True, 8, torch.float16), {}, TypeError, "num_kv_heads.*True"),
        ((12, 1, 8, torch.float16), {"tokens_per_state": 8}, ValueError, "block size 12 .*8"),
    ],
)
def test_attention_bad_input(args, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        FullAttentionSpec(*args, **kwargs)


def test_specs_are_frozen():
    spec = FullAttentionSpec(16, 1, 8, torch.float16)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.block_size = 32


_EVERY_KIND = [
    FullAttentionSpec(16, 2, 8, torch.float16),
    SlidingWindowSpec(16, 2, 8, torch.float16, sliding_window=32),
    ChunkedLocalAttentionSpec(16, 2, 8, torch.float16, attention_chunk_size=32),
    MLAAttentionSpec(16, 1, 8, torch.float16),
    CrossAttentionSpec(16, 2, 8, torch.float16),
    EncoderOnlyAttentionSpec(16, 2, 8, torch.float16),
    MambaSpec(16, [(3, 4)], [torch.float32]),
]


@pytest.mark.parametrize("spec", _EVERY_KIND, ids=lambda s: type(s).__name__)
def test_has_cache_pages_says_whether_the_plan_gives_the_layer_bytes(spec):
    specs = {"x.0": FullAttentionSpec(16, 2, 8, torch.float16), "y.0": spec}
    config = plan_kv_cache(specs, "LBNHC", num_blocks=4)
    planned = {name for t in config.kv_cache_tensors for name in t.layers}
    assert spec.has_cache_pages == ("y.0" in planned)
    assert spec.has_cache_pages == (not isinstance(spec, EncoderOnlyAttentionSpec))
    group = UniformTypeKVCacheSpecs(16, {"a": spec, "b": spec})
    assert group.has_cache_pages == spec.has_cache_pages


@pytest.mark.parametrize("spec", _EVERY_KIND, ids=lambda s: type(s).__name__)
def test_is_attention_marks_the_layers_an_attention_backend_serves(spec):
    assert spec.is_attention == isinstance(spec, AttentionSpec)
    assert UniformTypeKVCacheSpecs(16, {"a": spec, "b": spec}).is_attention == spec.is_attention
    assert KVCacheSpec(16).is_attention is False and KVCacheSpec(16).has_cache_pages is True
