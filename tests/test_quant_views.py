"""Data and scale views of quantized caches in every layout.

Invariants, in words: the data view keeps the ``[B, H, N, C]`` shape of the storage dtype with
rows of ``C`` contiguous elements, 16-byte aligned; the scale view is float32 ``[B, H, N, 2]``;
together the data and scale views of every (layer, block) address each byte of the allocation
exactly once (so no two blocks or layers share a byte and no scale overlaps data), and the bytes
of block ``b`` are those the zeroer clears and a transfer plan moves for ``b``.
"""

from __future__ import annotations

import pytest
import torch
from _quant_caches import MODES, PER_TOKEN_HEAD, byte_offsets
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import FullAttentionSpec, KVCacheLayout, allocate_kv_cache, plan_kv_cache
from kvcore.memory.views import allocate_scale_views
from kvcore.specs.quant import quantize_specs

LAYOUTS = list(KVCacheLayout)


def _plan(mode, layout, *, layers=3, heads=2, head_size=16, block_size=16, blocks=5, kernel=None):
    spec = quantize_specs({"a": FullAttentionSpec(block_size, heads, head_size, torch.bfloat16)}, mode)["a"]
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    config = plan_kv_cache(dict.fromkeys(names, spec), layout, num_blocks=blocks)
    kernels = None if kernel is None else [kernel]
    data = allocate_kv_cache(config, "cpu", kernel_block_sizes=kernels)
    buffer = torch.empty(0, dtype=torch.int8).set_(next(iter(data.values())).untyped_storage())
    return spec, config, names, data, allocate_scale_views(config, buffer, kernels), buffer


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("mode", MODES)
def test_view_shapes_strides_and_alignment(mode, layout):
    spec, config, names, data, scales, buffer = _plan(mode, layout, head_size=64, heads=4)
    for name in names:
        view = data[name]
        assert view.dtype == spec.dtype and tuple(view.shape) == (5, 4, 16, 128)
        assert view.stride(-1) == 1 and all(s % 16 == 0 for s in view.stride()[:3])
        assert (view.data_ptr() - buffer.data_ptr()) % 16 == 0
    if spec.kv_quant == "per_tensor":
        assert scales == {}
        return
    for name in names:
        s = scales[name]
        assert s.dtype == torch.float32 and tuple(s.shape) == (5, 4, 16, 2) and s.stride(-1) == 1
        assert s.stride(0) * 4 == data[name].stride(0)  # same block stride: scales are in the page


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(list(MODES)), layout=st.sampled_from(LAYOUTS), layers=st.integers(1, 3),
    heads=st.integers(1, 3), head_size=st.sampled_from([4, 8, 12, 16]), block_size=st.sampled_from([1, 2, 4, 6]),
    blocks=st.integers(2, 4),
)
def test_data_and_scales_of_every_layer_and_block_cover_each_byte_once(
    mode, layout, layers, heads, head_size, block_size, blocks
):
    spec, config, names, data, scales, buffer = _plan(mode, layout, layers=layers, heads=heads,
                                                       head_size=head_size, block_size=block_size, blocks=blocks)
    base = buffer.storage_offset()
    owner = torch.full((buffer.numel(),), -1, dtype=torch.int64)
    for li, name in enumerate(names):
        for b in range(blocks):
            for views in (data, scales):
                if name in views:
                    offsets = byte_offsets(views[name][b]).flatten() - base
                    assert (owner[offsets] == -1).all(), "two views address one byte"
                    owner[offsets] = li * blocks + b
    assert (owner >= 0).all(), "a byte of the allocation belongs to no view"
    page = spec.page_size_bytes
    assert buffer.numel() == layers * blocks * page
    for li in range(layers):  # every (layer, block) owns exactly one page worth of bytes
        for b in range(blocks):
            assert int((owner == li * blocks + b).sum()) == page


@pytest.mark.parametrize("mode", PER_TOKEN_HEAD)
def test_split_kernel_blocks_keep_their_scales_in_their_kernel_page(mode):
    spec, config, names, data, scales, buffer = _plan(mode, "LBNHC", block_size=64, kernel=16, blocks=3)
    view, s = data[names[0]], scales[names[0]]
    assert tuple(view.shape) == (12, 2, 16, 32) and tuple(s.shape) == (12, 2, 16, 2)
    kernel_page = 16 * 2 * (32 + 8)
    assert view.stride(0) == kernel_page and s.stride(0) * 4 == kernel_page
    assert s.data_ptr() - view.data_ptr() == 16 * 2 * 32  # after the kernel block's data rows
