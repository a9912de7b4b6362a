"""create_kv_cache_views: worked examples, kernel-block splitting and layout invariants."""

from __future__ import annotations

from fractions import Fraction

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.memory.config import KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.memory.views import create_kv_cache_views
from kvcore.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec


def make_tensor(spec, num_blocks, num_layers, layout, offset=0, slack=0):
    """A tensor laid out by compute_layout_strides, sized to hold every page."""
    s = compute_layout_strides(spec, num_blocks, num_layers, layout)
    extents = (num_layers, num_blocks, spec.num_heads, spec.num_states, spec.state_content_size_bytes)
    span = 1 + sum((n - 1) * st for n, st in zip(extents, s))
    last_page = s[0] * (num_layers - 1) + s[1] * (num_blocks - 1) + spec.page_size_bytes
    size = offset + max(span, last_page) + slack
    layers = [f"layer.{i}" for i in range(num_layers)]
    return KVCacheTensor(size, layers, layer_stride=s[0], block_stride=s[1], offset=offset), s


def random_bytes(n, generator=None):
    """Random non-zero bytes."""
    return torch.randint(1, 256, (n,), dtype=torch.uint8, generator=generator).view(torch.int8)


def byte_offsets(view, raw):
    """Every byte ``view`` addresses, relative to the start of ``raw``."""
    item = view.element_size()
    addr = torch.tensor(view.storage_offset() * item - raw.storage_offset())
    for size, stride in zip(view.shape, view.stride()):
        addr = addr.unsqueeze(-1) + torch.arange(size) * (stride * item)
    return (addr.unsqueeze(-1) + torch.arange(item)).flatten()


def flip(block):
    """Overwrite every byte of one view block with its complement."""
    raw8 = block.view(torch.int8)
    raw8.copy_(~raw8)


def test_worked_view_lbnhc_k_and_v():
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    tensor, strides = make_tensor(spec, 8, 3, "LBNHC")
    assert strides == (65536, 8192, 128, 512, 1)
    raw = random_bytes(tensor.size)
    views = create_kv_cache_views(raw, spec, 8, "LBNHC", tensor)
    assert len(views) == 3
    for view in views:
        assert view.shape == (8, 4, 16, 64) and view.dtype is torch.float16
        assert view.stride() == (4096, 64, 256, 1)
        assert view.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    k, v = views[1][..., :32], views[1][..., 32:]
    k[2, 3, 5, 7] = 1.5
    v[2, 3, 5, 0] = -2.0
    # layer 1, block 2, head 3, state 5: byte 65536 + 2*8192 + 3*128 + 5*512
    at = 65536 + 2 * 8192 + 3 * 128 + 5 * 512
    assert raw[at + 14 : at + 16].view(torch.float16).item() == 1.5
    assert raw[at + 64 : at + 66].view(torch.float16).item() == -2.0


@pytest.mark.parametrize(
    "layout, view_strides",
    [
        # element strides of a layer view [B, H, N, C] (fp16: bytes / 2)
        ("LBHNC", (4096, 1024, 64, 1)),
        ("LHBNC", (1024, 8192, 64, 1)),
        ("BLHNC", (12288, 1024, 64, 1)),
        ("BLNHC", (12288, 64, 256, 1)),
        ("BHLNC", (12288, 3072, 64, 1)),
    ],
)
def test_worked_view_strides(layout, view_strides):
    spec = FullAttentionSpec(16, 4, 32, torch.float16)
    tensor, strides = make_tensor(spec, 8, 3, layout)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, 8, layout, tensor)
    assert views[0].stride() == view_strides
    assert views[2].storage_offset() * 2 == 2 * strides[0]


def test_views_at_raw_offset_and_tensor_offset():
    spec = FullAttentionSpec(4, 1, 2, torch.float32)  # page 4 * 16 = 64 bytes
    tensor, strides = make_tensor(spec, 3, 2, "BLNHC", offset=16)
    assert strides[:2] == (64, 128)
    big = random_bytes(tensor.size + 8)
    before = big.clone()
    views = create_kv_cache_views(big[8:], spec, 3, "BLNHC", tensor)
    flip(views[1][2])
    # layer 1 block 2 starts at byte 8 (raw) + 16 (offset) + 64 + 2 * 128 of big
    start = 8 + 16 + 64 + 256
    assert torch.equal((big != before).nonzero().flatten(), torch.arange(start, start + 64))


def kernel_split_case(layout, num_layers, num_heads, padded=None):
    spec = FullAttentionSpec(16, num_heads, 4, torch.float16, page_size_padded=padded)
    tensor, _ = make_tensor(spec, 3, num_layers, layout)
    return spec, tensor


@pytest.mark.parametrize(
    "layout, num_layers, num_heads",
    [("LBHNC", 2, 2), ("LBNHC", 3, 2), ("BLHNC", 1, 2), ("BLNHC", 1, 3), ("BHLNC", 1, 2), ("LHBNC", 2, 1)],
)
def test_kernel_split_allowed(layout, num_layers, num_heads):
    spec, tensor = kernel_split_case(layout, num_layers, num_heads)
    page = spec.page_size_bytes  # heads * 16 * 16 bytes
    raw = random_bytes(tensor.size)
    views = create_kv_cache_views(raw, spec, 3, layout, tensor, kernel_block_size=4)
    for layer, view in enumerate(views):
        assert view.shape == (12, num_heads, 4, 8)
        for b in range(3):
            for j in range(4):
                got = byte_offsets(view[b * 4 + j], raw).sort().values
                start = layer * tensor.layer_stride + b * tensor.block_stride + j * page // 4
                assert torch.equal(got, torch.arange(start, start + page // 4))


REMEDIES = r"smaller manager block size \(4 tokens\) or a layer-compact layout such as LBNHC"


@pytest.mark.parametrize(
    "layout, num_layers, num_heads, padded",
    [
        ("BLHNC", 2, 1, None),
        ("BLNHC", 2, 2, None),
        ("BHLNC", 2, 1, None),
        ("LHBNC", 2, 2, None),
        ("LHBNC", 1, 2, None),
        ("LBNHC", 2, 1, 384),
        ("BLHNC", 1, 1, 384),
    ],
)
def test_kernel_split_refused(layout, num_layers, num_heads, padded):
    spec, tensor = kernel_split_case(layout, num_layers, num_heads, padded)
    raw = random_bytes(tensor.size)
    before = raw.clone()
    with pytest.raises(ValueError, match=f"{layout} does not store .* as dense pages.*{REMEDIES}"):
        create_kv_cache_views(raw, spec, 3, layout, tensor, kernel_block_size=4)
    assert torch.equal(raw, before)


def test_state_cache_view_and_no_split():
    spec = MambaSpec(8, [(2, 3), (4,)], [torch.float32, torch.float32])
    tensor, _ = make_tensor(spec, 5, 2, "LBNHC")
    raw = random_bytes(tensor.size)
    views = create_kv_cache_views(raw, spec, 5, "LBNHC", tensor)
    assert views[0].shape == (5, 1, 1, 10) and views[0].dtype is torch.float32
    ssm, conv = spec.split_states(views[1])
    assert ssm.shape == (5, 2, 3) and conv.shape == (5, 4)
    ssm[4, 1, 2] = 3.25
    at = 1 * tensor.layer_stride + 4 * tensor.block_stride + 5 * 4
    assert raw[at : at + 4].view(torch.float32).item() == 3.25
    with pytest.raises(ValueError, match="one state per block"):
        create_kv_cache_views(raw, spec, 5, "LBNHC", tensor, kernel_block_size=4)


def test_mla_kernel_view():
    spec = MLAAttentionSpec(256, 1, 16, torch.bfloat16, tokens_per_state=4)
    tensor, _ = make_tensor(spec, 2, 2, "LBNHC")
    raw = random_bytes(tensor.size)
    for kernel, shape in [(None, (2, 1, 64, 16)), (256, (2, 1, 64, 16)), (64, (8, 1, 16, 16))]:
        views = create_kv_cache_views(raw, spec, 2, "LBNHC", tensor, kernel_block_size=kernel)
        assert views[1].shape == shape
    with pytest.raises(ValueError, match="block size 2 .*tokens_per_state=4"):
        create_kv_cache_views(raw, spec, 2, "LBNHC", tensor, kernel_block_size=2)


def test_bad_input():
    spec = FullAttentionSpec(16, 2, 4, torch.float16)
    tensor, _ = make_tensor(spec, 3, 2, "LBNHC")
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    with pytest.raises(TypeError, match="1-D int8.*float32"):
        create_kv_cache_views(raw.float(), spec, 3, "LBNHC", tensor)
    with pytest.raises(TypeError, match="1-D int8.*list"):
        create_kv_cache_views([0] * 10, spec, 3, "LBNHC", tensor)
    with pytest.raises(ValueError, match="'QQ'"):
        create_kv_cache_views(raw, spec, 3, "QQ", tensor)
    with pytest.raises(ValueError, match="num_blocks.*0"):
        create_kv_cache_views(raw, spec, 0, "LBNHC", tensor)
    with pytest.raises(ValueError, match="16 is not divisible by kernel block size 5"):
        create_kv_cache_views(raw, spec, 3, "LBNHC", tensor, kernel_block_size=5)
    with pytest.raises(ValueError, match="kernel_block_size.*-4"):
        create_kv_cache_views(raw, spec, 3, "LBNHC", tensor, kernel_block_size=-4)
    with pytest.raises(TypeError, match="KVCacheTensor.*'t'"):
        create_kv_cache_views(raw, spec, 3, "LBNHC", "t")
    with pytest.raises(TypeError, match="KVCacheSpec.*'s'"):
        create_kv_cache_views(raw, "s", 3, "LBNHC", tensor)
    # More blocks than the tensor holds.
    with pytest.raises(ValueError, match="'layer.1' spans bytes.*holds"):
        create_kv_cache_views(raw, spec, 4, "LBNHC", tensor)
    # A buffer shorter than the tensor.
    with pytest.raises(ValueError, match="spans bytes"):
        create_kv_cache_views(raw[:-1], spec, 3, "LBNHC", tensor)
    # Strides not aligned to the fp16 element.
    odd = KVCacheTensor(tensor.size, tensor.layers, layer_stride=tensor.layer_stride, block_stride=1023)
    with pytest.raises(ValueError, match="not multiples of the 2-byte"):
        create_kv_cache_views(raw, spec, 2, "LBNHC", odd)
    with pytest.raises(ValueError, match="start byte 1 "):
        create_kv_cache_views(torch.zeros(tensor.size + 1, dtype=torch.int8)[1:], spec, 3, "LBNHC", tensor)


# ---------------------------------------------------------------- properties


@st.composite
def view_cases(draw):
    kind = draw(st.sampled_from(["attn", "attn", "attn", "mla", "mamba"]))
    dtype = draw(st.sampled_from([torch.int8, torch.float16, torch.float32]))
    padded_extra = draw(st.sampled_from([None, None, None, None, 1, 3]))
    if kind == "mamba":
        shapes = draw(st.lists(st.lists(st.integers(1, 3), max_size=2).map(tuple), min_size=1, max_size=3))
        block_size = draw(st.sampled_from([1, 2, 4, 8]))
        spec = MambaSpec(block_size, shapes, [dtype] * len(shapes))
    else:
        tps = draw(st.sampled_from([1, 1, 2, 4, Fraction(1, 2), 0]))
        unit = tps if isinstance(tps, int) and tps > 0 else 1
        block_size = unit * draw(st.sampled_from([1, 2, 4, 6, 8, 8]))
        heads = 1 if kind == "mla" else draw(st.integers(1, 3))  # MLA: one latent vector
        slots = draw(st.sampled_from([None, heads + 1]))
        head_size = draw(st.sampled_from([1, 2, 4]))
        cls = MLAAttentionSpec if kind == "mla" else FullAttentionSpec
        extra = {} if kind == "mla" else {"head_size_v": draw(st.sampled_from([None, 1, 3]))}
        spec = cls(block_size, heads, head_size, dtype, tokens_per_state=tps, num_head_slots=slots, **extra)
    if padded_extra is not None:
        spec = attrs.evolve(spec, page_size_padded=spec.real_page_size_bytes + padded_extra * dtype.itemsize)
    divisors = [k for k in range(1, spec.block_size + 1) if spec.block_size % k == 0]
    # NOTE: weighted towards real splits, the interesting case.
    kernel = draw(st.sampled_from([None, *divisors]) | st.sampled_from(divisors[:-1] or [None]))
    kernel = spec.block_size + 1 if draw(st.integers(0, 9)) == 0 else kernel
    layout = draw(st.sampled_from(list(KVCacheLayout)))
    num_layers = draw(st.sampled_from([1, 1, 2, 3]))
    num_blocks = draw(st.integers(1, 4))
    offset = draw(st.sampled_from([0, 8, 24]))
    return spec, kernel, layout, num_layers, num_blocks, offset


def expected_valid(spec, kernel, layout, num_layers):
    """Which combinations the spec allows, derived independently of kvcore."""
    padded = spec.page_size_padded is not None
    if padded and not layout.is_block_compact and spec.num_heads > 1:
        return False
    if kernel is None or kernel == spec.block_size:
        return True
    if spec.block_size % kernel:
        return False
    tps = spec.tokens_per_state
    if padded or tps <= 0:
        return False
    if Fraction(kernel) / tps != int(Fraction(kernel) / tps):
        return False
    dense = layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
    dense |= layout is KVCacheLayout.LHBNC and spec.num_heads == 1
    dense |= layout.is_block_outermost and num_layers == 1
    return dense


@settings(max_examples=50, deadline=None)
@given(view_cases(), st.randoms(use_true_random=False))
def test_view_invariants(case, rnd):
    spec, kernel, layout, num_layers, num_blocks, offset = case
    if not expected_valid(spec, kernel, layout, num_layers):
        with pytest.raises(ValueError):
            make_views(spec, kernel, layout, num_layers, num_blocks, offset, rnd)
        return
    check_views(spec, kernel, layout, num_layers, num_blocks, offset, rnd)


@st.composite
def split_cases(draw):
    """Only valid real splits: dense pages, kernel blocks of whole states."""
    tps = draw(st.sampled_from([1, 2, 4, Fraction(1, 2)]))
    unit = tps if isinstance(tps, int) else 1
    kernel = unit * draw(st.sampled_from([1, 2, 3]))
    block_size = kernel * draw(st.sampled_from([2, 3, 4]))
    dtype = draw(st.sampled_from([torch.int8, torch.float16, torch.float32]))
    cls = draw(st.sampled_from([FullAttentionSpec, MLAAttentionSpec]))
    heads = 1 if cls is MLAAttentionSpec else draw(st.integers(1, 3))
    spec = cls(block_size, heads, draw(st.sampled_from([1, 2, 4])), dtype, tokens_per_state=tps)
    layout = draw(st.sampled_from(list(KVCacheLayout)))
    if layout is KVCacheLayout.LHBNC:
        spec = attrs.evolve(spec, num_kv_heads=1)
    num_layers = 1 if layout.is_block_outermost else draw(st.integers(1, 3))
    return spec, kernel, layout, num_layers, draw(st.integers(1, 3)), draw(st.sampled_from([0, 8]))


@settings(max_examples=40, deadline=None)
@given(split_cases(), st.randoms(use_true_random=False))
def test_kernel_split_invariants(case, rnd):
    assert expected_valid(case[0], case[1], case[2], case[3])
    check_views(*case, rnd)


def make_views(spec, kernel, layout, num_layers, num_blocks, offset, rnd):
    tensor, manager_strides = make_tensor(spec, num_blocks, num_layers, layout, offset, slack=8)
    raw = random_bytes(tensor.size, torch.Generator().manual_seed(rnd.randint(0, 2**31)))
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor, kernel_block_size=kernel)
    return tensor, manager_strides, raw, views


def check_views(spec, kernel, layout, num_layers, num_blocks, offset, rnd):
    tensor, manager_strides, raw, views = make_views(
        spec, kernel, layout, num_layers, num_blocks, offset, rnd
    )
    ratio = 1 if kernel is None else spec.block_size // kernel
    page = spec.real_page_size_bytes
    assert len(views) == num_layers

    # Every view lies inside the tensor; distinct (layer, kernel block) pairs share no byte.
    pieces = []
    for view in views:
        assert view.dtype == spec.view_dtype
        assert view.shape[:2] == (num_blocks * ratio, spec.num_heads)
        assert view.shape[3] * view.element_size() == spec.state_content_size_bytes
        for kb in range(view.shape[0]):
            pieces.append(byte_offsets(view[kb], raw))
    every = torch.cat(pieces)
    assert every.min() >= offset and every.max() < tensor.size
    assert every.unique().numel() == every.numel()
    assert every.numel() == num_layers * num_blocks * page

    # Writing one kernel block changes exactly its slice of the manager block's page.
    layer = rnd.randrange(num_layers)
    block = rnd.randrange(num_blocks)
    j = rnd.randrange(ratio)
    before = raw.clone()
    flip(views[layer][block * ratio + j])
    changed = (raw != before).nonzero().flatten()
    base = offset + layer * tensor.layer_stride + block * tensor.block_stride
    if ratio > 1 or layout.is_block_compact:
        expected = torch.arange(base + j * page // ratio, base + (j + 1) * page // ratio)
    else:
        # Heads sit apart: one run of N*C bytes per head.
        run = spec.num_states * spec.state_content_size_bytes
        expected = torch.cat([torch.arange(run) + base + h * manager_strides[2] for h in range(spec.num_heads)])
    assert torch.equal(changed, expected.sort().values)
