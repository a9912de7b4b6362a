"""KVCacheLayout and compute_layout_strides: worked examples and refusals."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

ALL = list(KVCacheLayout)

# name: (stride_order, layer_view_order, layer_compact, block_outermost, block_compact, block_contiguous)
PROPERTIES = {
    "LBHNC": ((0, 1, 2, 3, 4), (0, 1, 2, 3), True, False, True, True),
    "LBNHC": ((0, 1, 3, 2, 4), (0, 2, 1, 3), True, False, True, False),
    "LHBNC": ((0, 2, 1, 3, 4), (1, 0, 2, 3), True, False, False, False),
    "BLHNC": ((1, 0, 2, 3, 4), (0, 1, 2, 3), False, True, True, True),
    "BLNHC": ((1, 0, 3, 2, 4), (0, 2, 1, 3), False, True, True, False),
    "BHLNC": ((1, 2, 0, 3, 4), (0, 1, 2, 3), False, True, False, False),
}


def test_six_members_in_spec_order():
    assert [m.name for m in KVCacheLayout] == list(PROPERTIES)


@pytest.mark.parametrize("name", list(PROPERTIES))
def test_layout_properties(name):
    layout = KVCacheLayout[name]
    order, view_order, layer_compact, block_outer, block_compact, block_contig = PROPERTIES[name]
    assert layout.stride_order == order
    assert layout.layer_view_order == view_order
    assert layout.is_layer_compact is layer_compact
    assert layout.is_block_outermost is block_outer
    assert layout.is_block_compact is block_compact
    assert layout.is_block_contiguous is block_contig


@pytest.mark.parametrize(
    "text, expected",
    [
        ("LBNHC", KVCacheLayout.LBNHC),
        ("lbnhc", KVCacheLayout.LBNHC),
        ("BhLnC", KVCacheLayout.BHLNC),
        ("NHD", KVCacheLayout.LBNHC),
        ("nhd", KVCacheLayout.LBNHC),
        ("HND", KVCacheLayout.LBHNC),
        ("hnd", KVCacheLayout.LBHNC),
        (KVCacheLayout.BLNHC, KVCacheLayout.BLNHC),
    ],
)
def test_parse(text, expected):
    assert KVCacheLayout.parse(text) is expected


@pytest.mark.parametrize("text", ["LBNH", "XYZ", "", "LBNHCC", "BLOCK"])
def test_parse_unknown_lists_valid_names(text):
    with pytest.raises(ValueError) as err:
        KVCacheLayout.parse(text)
    msg = str(err.value)
    assert repr(text) in msg
    for name in [*PROPERTIES, "NHD", "HND"]:
        assert name in msg


@pytest.mark.parametrize("value", [3, None, b"LBNHC"])
def test_parse_wrong_type(value):
    with pytest.raises(TypeError, match=repr(value).replace("(", r"\(").replace(")", r"\)")):
        KVCacheLayout.parse(value)


# 3 layers, 8 blocks of 16 tokens, fp16, 4 heads of head size 32:
# extents L=3 B=8 H=4 N=16 C=(32+32)*2=128 bytes; page = 4*16*128 = 8192.
WORKED = {
    # C=1, N=128, H=16*128=2048, B=4*2048=8192, L=8*8192=65536
    "LBHNC": (65536, 8192, 2048, 128, 1),
    # C=1, H=128, N=4*128=512, B=16*512=8192, L=65536
    "LBNHC": (65536, 8192, 128, 512, 1),
    # C=1, N=128, B=16*128=2048, H=8*2048=16384, L=4*16384=65536
    "LHBNC": (65536, 2048, 16384, 128, 1),
    # C=1, N=128, H=2048, L=4*2048=8192, B=3*8192=24576
    "BLHNC": (8192, 24576, 2048, 128, 1),
    # C=1, H=128, N=512, L=16*512=8192, B=24576
    "BLNHC": (8192, 24576, 128, 512, 1),
    # C=1, N=128, L=16*128=2048, H=3*2048=6144, B=4*6144=24576
    "BHLNC": (2048, 24576, 6144, 128, 1),
}


@pytest.mark.parametrize("name", list(WORKED))
def test_worked_strides(name):
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    assert spec.page_size_bytes == 8192
    assert compute_layout_strides(spec, 8, 3, name) == WORKED[name]
    # A kernel block equal to the block changes nothing.
    assert compute_layout_strides(spec, 8, 3, name, kernel_block_size=16) == WORKED[name]


@pytest.mark.parametrize("name", list(WORKED))
def test_worked_strides_with_kernel_blocks(name):
    # Kernel blocks of 4 tokens: B=8*4=32 kernel blocks, N=4; kernel page 4*4*128=2048.
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    expected = {
        "LBHNC": (65536, 2048, 512, 128, 1),  # N=128 H=4*128 B=4*512 L=32*2048
        "LBNHC": (65536, 2048, 128, 512, 1),  # H=128 N=512 B=4*512 L=32*2048
        "LHBNC": (65536, 512, 16384, 128, 1),  # N=128 B=4*128 H=32*512 L=4*16384
        "BLHNC": (2048, 6144, 512, 128, 1),  # N=128 H=512 L=2048 B=3*2048
        "BLNHC": (2048, 6144, 128, 512, 1),
        "BHLNC": (512, 6144, 1536, 128, 1),  # N=128 L=512 H=3*512 B=4*1536
    }[name]
    assert compute_layout_strides(spec, 8, 3, name, kernel_block_size=4) == expected


def test_fixed_strides_replace_running_product():
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    # BLNHC with the block stride fixed to 30000 bytes: L stays 8192, B is 30000.
    strides = compute_layout_strides(spec, 8, 3, "BLNHC", fixed_strides=(None, 30000, None, None, None))
    assert strides == (8192, 30000, 128, 512, 1)
    # Fixing an inner dim moves everything outside it.
    strides = compute_layout_strides(spec, 8, 3, "LBHNC", fixed_strides=(None, None, 4096, None, None))
    assert strides == (8 * 16384, 16384, 4096, 128, 1)


# Padding: 8 tokens x 1 head x head size 8 fp16 = 8 * (8+8)*2 = 256-byte page, padded to 384.
# 2 layers, 3 blocks.
PADDED = {
    # C=1 N=32 H=256 B=max(256,384)=384 L=3*384
    "LBHNC": (1152, 384, 256, 32, 1),
    # C=1 H=32 N=32 B=max(256,384)=384 L=1152
    "LBNHC": (1152, 384, 32, 32, 1),
    # C=1 N=32 H=256 L=max(256,384)=384 B=2*384
    "BLHNC": (384, 768, 256, 32, 1),
    "BLNHC": (384, 768, 32, 32, 1),
    # one head: the grid L*H*B = L*B. C=1 N=32 B=384 H=3*384 L=1*1152
    "LHBNC": (1152, 384, 1152, 32, 1),
    # C=1 N=32 L=384 H=2*384 B=768
    "BHLNC": (384, 768, 768, 32, 1),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_page(name):
    spec = FullAttentionSpec(8, 1, 8, torch.float16, page_size_padded=384)
    assert spec.real_page_size_bytes == 256
    assert spec.page_size_bytes == 384
    assert compute_layout_strides(spec, 3, 2, name) == PADDED[name]


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_padding_refused_with_heads_between_layers_and_blocks(name):
    spec = FullAttentionSpec(8, 2, 8, torch.float16, page_size_padded=768)
    with pytest.raises(ValueError, match=f"{name}.*2 heads.*LBNHC"):
        compute_layout_strides(spec, 3, 2, name)


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_padding_with_heads_in_block_compact_layouts(name):
    # Two heads: page 2*8*32=512, padded to 640.
    spec = FullAttentionSpec(8, 2, 8, torch.float16, page_size_padded=640)
    strides = compute_layout_strides(spec, 3, 2, name)
    inner_grid = strides[0] if name.startswith("B") else strides[1]
    assert inner_grid == 640


def test_padding_with_splitting_refused():
    spec = FullAttentionSpec(8, 1, 8, torch.float16, page_size_padded=384)
    with pytest.raises(ValueError, match="384.*manager block size of 4"):
        compute_layout_strides(spec, 3, 2, "LBNHC", kernel_block_size=4)


# MLA, 1 latent head of 16 bf16 (C=32 bytes), 256-token blocks, tokens_per_state=4:
# N=256/4=64 states, page 64*32=2048. 2 layers, 3 blocks, LBNHC.
@pytest.mark.parametrize(
    "kernel, expected",
    [
        (None, (6144, 2048, 32, 32, 1)),  # C=1 H=32 N=1*32 B=64*32 L=3*2048
        (256, (6144, 2048, 32, 32, 1)),  # kernel block = block: unchanged
        (64, (6144, 512, 32, 32, 1)),  # N=64/4=16, B=3*4=12: B=16*32=512 L=12*512
        (16, (6144, 128, 32, 32, 1)),  # N=4, B=48: B=4*32=128 L=48*128
    ],
)
def test_mla_tokens_per_state(kernel, expected):
    spec = MLAAttentionSpec(256, 1, 16, torch.bfloat16, tokens_per_state=4)
    assert spec.state_content_size_bytes == 32
    assert spec.num_states == 64
    assert compute_layout_strides(spec, 3, 2, "LBNHC", kernel_block_size=kernel) == expected


def test_mla_kernel_block_not_whole_states():
    spec = MLAAttentionSpec(256, 1, 16, torch.bfloat16, tokens_per_state=4)
    with pytest.raises(ValueError, match="block size 2 .*tokens_per_state=4"):
        compute_layout_strides(spec, 3, 2, "LBNHC", kernel_block_size=2)


def test_fractional_tokens_per_state_strides():
    # Two states per token: 4 tokens -> 8 states of (8+8)*4=64 bytes, 2 heads.
    spec = FullAttentionSpec(4, 2, 8, torch.float32, tokens_per_state=Fraction(1, 2))
    # LBHNC: C=1 N=64 H=8*64=512 B=2*512=1024 L=5*1024
    assert compute_layout_strides(spec, 5, 1, "LBHNC") == (5120, 1024, 512, 64, 1)
    # kernel 2 tokens -> 4 states, B=10: N=64 H=256 B=512 L=5120
    assert compute_layout_strides(spec, 5, 1, "LBHNC", kernel_block_size=2) == (5120, 512, 256, 64, 1)


def test_state_cache_strides_and_no_split():
    spec = MambaSpec(16, [(4, 8), (2,)], [torch.float32, torch.float32])
    # page = (32+2)*4 = 136 bytes, one state: BLHNC, 2 layers, 3 blocks
    assert compute_layout_strides(spec, 3, 2, "BLHNC") == (136, 272, 136, 136, 1)
    with pytest.raises(ValueError, match="one state per block.*kernel_block_size=16"):
        compute_layout_strides(spec, 3, 2, "LBNHC", kernel_block_size=8)


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        ({"num_blocks": 0}, ValueError, "num_blocks.* 0"),
        ({"num_blocks": -3}, ValueError, "num_blocks.*-3"),
        ({"num_layers": 0}, ValueError, "num_layers.* 0"),
        ({"num_blocks": 2.5}, TypeError, "num_blocks.*2.5"),
        ({"num_layers": True}, TypeError, "num_layers.*True"),
        ({"kernel_block_size": 0}, ValueError, "kernel_block_size.* 0"),
        ({"kernel_block_size": 5}, ValueError, "16 is not divisible by kernel block size 5"),
        ({"kernel_block_size": 32}, ValueError, "16 is not divisible by kernel block size 32"),
        ({"kernel_block_size": "8"}, TypeError, "kernel_block_size.*'8'"),
        ({"layout": "ZZZ"}, ValueError, "'ZZZ'.*LBNHC"),
        ({"fixed_strides": (None,) * 4}, ValueError, "5 entries.*got 4"),
        ({"fixed_strides": (None, -1, None, None, None)}, ValueError, "stride of B.*-1"),
        ({"fixed_strides": 7}, TypeError, "fixed_strides.*7"),
    ],
)
def test_bad_arguments(kwargs, exc, text):
    args = {
        "spec": FullAttentionSpec(16, 4, 32, torch.float16),
        "num_blocks": 8,
        "num_layers": 3,
        "layout": "LBNHC",
    }
    args.update(kwargs)
    with pytest.raises(exc, match=text):
        compute_layout_strides(**args)


def test_bad_spec_type():
    with pytest.raises(TypeError, match="KVCacheSpec.*'spec'"):
        compute_layout_strides("spec", 8, 3, "LBNHC")
    group = UniformTypeKVCacheSpecs(
        16,
        {
            "a": FullAttentionSpec(16, 4, 32, torch.float16),
            "b": FullAttentionSpec(16, 2, 32, torch.float16),
        },
    )
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*kv_cache_specs\[name\]"):
        compute_layout_strides(group, 8, 2, "LBNHC")
