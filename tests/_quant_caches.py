"""Quantized KV caches for the tests: every mode, any layout, on the torch backend, and the byte
sets their data and scale views address."""

from __future__ import annotations

import functools

import torch

import kvcore_torch.plugin
from kvcore import FullAttentionSpec, KVCache, get_plugin_manager

#: kv_cache_dtype -> (storage dtype, kv_quant)
MODES = {
    "fp8_e4m3": (torch.float8_e4m3fn, "per_tensor"),
    "fp8_e5m2": (torch.float8_e5m2, "per_tensor"),
    "int8_per_token_head": (torch.int8, "per_token_head"),
    "fp8_per_token_head": (torch.float8_e4m3fn, "per_token_head"),
}
PER_TOKEN_HEAD = [m for m, (_, q) in MODES.items() if q == "per_token_head"]


@functools.cache
def torch_only():
    """A plugin manager with the torch backend alone (whatever else is installed)."""
    pm = get_plugin_manager(autoload=False)
    pm.register(kvcore_torch.plugin, name="torch")
    return pm


def layer_specs(num_layers=3, heads=2, head_size=16, block_size=16, dtype=torch.float32):
    return {f"model.layers.{i}.self_attn": FullAttentionSpec(block_size, heads, head_size, dtype)
            for i in range(num_layers)}


def make_quant_cache(mode, layout, *, num_blocks=8, specs=None, **kw) -> KVCache:
    specs = specs or layer_specs()
    return KVCache.create(specs, dict.fromkeys(specs, "torch"), device="cpu", layout=layout,
                          num_blocks=num_blocks, max_num_seqs=4, max_model_len=128,
                          plugin_manager=torch_only(), kv_cache_dtype=mode, **kw)


def raw(kv: KVCache) -> torch.Tensor:
    view = next(iter(kv.kv_caches.values()))
    return torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())


def byte_offsets(view: torch.Tensor) -> torch.Tensor:
    """``[elements, itemsize]`` byte offsets, from the allocation's start, of every element."""
    offsets = torch.tensor(view.storage_offset(), dtype=torch.int64)
    for n, s in zip(view.shape, view.stride()):
        offsets = offsets[..., None] + torch.arange(n) * s
    size = view.element_size()
    return offsets.reshape(-1, 1) * size + torch.arange(size)


def block_rows(kv: KVCache, view: torch.Tensor, block_ids) -> torch.Tensor:
    """``view``'s rows of manager blocks ``block_ids``."""
    rows = view.shape[0] // kv.max_num_blocks
    return view[torch.tensor([b * rows + r for b in block_ids for r in range(rows)], dtype=torch.long)]


def block_byte_mask(kv: KVCache, block_ids) -> torch.Tensor:
    """Every byte the data and scale views of ``block_ids`` address, in every layer."""
    mask = torch.zeros(raw(kv).numel(), dtype=torch.bool)
    for views in (kv.kv_caches, kv.scale_caches):
        for view in views.values():
            rows = view.shape[0] // kv.max_num_blocks
            for b in block_ids:
                mask[byte_offsets(view[b * rows : (b + 1) * rows]).flatten()] = True
    return mask
