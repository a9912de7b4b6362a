"""``describe(kv_cache)``: the descriptor of a live :class:`kvcore.KVCache`.

Everything is read from public fields: the config (groups, specs), the views
as allocated (``kv_cache.kv_caches``: kernel-addressed for dense split
groups, manager-addressed otherwise), the negotiated kernel block sizes and
the attention groups' kernel block strides.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import AttentionSpec, KVCacheSpec, MambaSpec
from kvcore.transfer.descriptor import (
    Allocation,
    ContentMap,
    GroupDescriptor,
    KVCacheDescriptor,
    LayerDescriptor,
    StateSlice,
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def content_map(spec: KVCacheSpec) -> ContentMap:
    """What one (head, state) row of ``spec``'s pages holds."""
    content = spec.state_content_size_bytes
    if isinstance(spec, MambaSpec):
        states, start = [], 0
        for i, (shape, dtype, nbytes) in enumerate(zip(spec.shapes, spec.dtypes, spec.state_bytes)):
            states.append(StateSlice(i, shape, dtype_name(dtype), start, start + nbytes))
            start += nbytes
        return ContentMap("state", content, states=tuple(states))
    if isinstance(spec, AttentionSpec):
        tps = Fraction(spec.tokens_per_state)
        k_bytes = v_bytes = None
        if spec.state_content_bytes is None:
            item = spec.dtype.itemsize
            k_end = spec.head_size * item
            k_bytes = (0, k_end)
            if spec.head_size_v:
                v_bytes = (k_end, k_end + spec.head_size_v * item)
        return ContentMap(
            "attention", content, num_kv_heads=spec.num_kv_heads, num_head_slots=spec.num_heads,
            head_size=spec.head_size, head_size_v=spec.head_size_v,
            tokens_per_state=(tps.numerator, tps.denominator), k_bytes=k_bytes, v_bytes=v_bytes,
        )
    return ContentMap("raw", content)


def _kernel_sizes(kv: KVCache) -> list[int]:
    """Kernel block size per KV cache group (``kv.kernel_block_sizes`` skips encoder-only ones)."""
    sizes = iter(kv.kernel_block_sizes)
    out = []
    for group in kv.config.kv_cache_groups:
        spec = group.spec_of(group.layer_names[0])
        out.append(next(sizes) if spec.has_cache_pages else spec.block_size)
    return out


def _layer(name: str, view: torch.Tensor, spec: KVCacheSpec, base_ptr: int, num_blocks: int) -> LayerDescriptor:
    rows = view.shape[0] // num_blocks
    item = view.element_size()
    return LayerDescriptor(
        name=name,
        allocation=0,
        offset=view.data_ptr() - base_ptr,
        dtype=dtype_name(view.dtype),
        itemsize=item,
        shape=tuple(view.shape),
        strides=tuple(view.stride()),
        rows_per_block=rows,
        manager_block_stride=view.stride(0) * item * rows,
        block_bytes=rows * view.shape[1] * view.shape[2] * view.shape[3] * item,
        content=content_map(spec),
    )


def describe(kv_cache: KVCache) -> KVCacheDescriptor:
    """The :class:`KVCacheDescriptor` of ``kv_cache`` (one allocation, every group)."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"describe() needs a kvcore.KVCache, got {type(kv_cache).__name__}")
    # NOTE: views span the planned blocks (an elastic cache's max_num_blocks); ids go up to num_blocks now.
    config, num_blocks = kv_cache.config, kv_cache.num_blocks
    views = list(kv_cache.kv_caches.values())
    if views:
        storage = views[0].untyped_storage()
        allocations = (Allocation(0, str(views[0].device), storage.data_ptr(), storage.nbytes()),)
    else:
        allocations = ()
    base_ptr = allocations[0].base_ptr if allocations else 0
    groups = []
    for group_id, (group, kernel_size) in enumerate(zip(config.kv_cache_groups, _kernel_sizes(kv_cache))):
        spec = group.kv_cache_spec
        layers = tuple(
            _layer(name, kv_cache.kv_caches[name], group.spec_of(name), base_ptr, config.num_blocks)
            for name in group.layer_names
            if name in kv_cache.kv_caches and group.spec_of(name).has_layer_views
        )
        ratio = spec.block_size // kernel_size
        strides = {layer.manager_block_stride for layer in layers}
        attn_strides = [g.kernel_block_stride for g in kv_cache.attn_groups[group_id] if g.kernel_block_stride]
        groups.append(
            GroupDescriptor(
                group_id=group_id,
                spec_type=type(spec).__name__,
                block_size=spec.block_size,
                kernel_block_size=kernel_size,
                ratio=ratio,
                kernel_block_stride=attn_strides[0] if attn_strides else ratio,
                manager_block_stride=strides.pop() if len(strides) == 1 else None,
                layer_names=tuple(group.layer_names),
                layers=layers,
            )
        )
    return KVCacheDescriptor(
        layout=kv_cache.layout.name, num_blocks=num_blocks, allocations=allocations, groups=tuple(groups)
    )
