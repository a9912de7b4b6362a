"""Elastic KV caches of every shape the elastic tests cover, and byte-level helpers."""

from __future__ import annotations

import torch
from _transfer_caches import KINDS, Fixed8Backend, layer_specs, plugin_manager

from kvcore import KVCache, MambaSpec
from kvcore_torch.backend import TorchAttentionBackend

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


def make_elastic(kind: str, layout: str, num_blocks: int | None, max_num_blocks: int | None,
                 device: str = "cpu", **kw) -> KVCache:  # fmt: skip
    specs = layer_specs(kind, torch.float16)
    backend = Fixed8Backend if kind == "split" else TorchAttentionBackend
    return KVCache.create(
        specs, {n: backend for n, s in specs.items() if not isinstance(s, MambaSpec)},
        device=device, layout=layout, num_blocks=num_blocks, max_num_blocks=max_num_blocks,
        max_num_seqs=2, max_model_len=64, plugin_manager=plugin_manager(), **kw,
    )


def block_bytes(kv: KVCache, layer: str, block_id: int) -> torch.Tensor:
    """The bytes of manager block ``block_id`` in ``layer``'s view (a live view, not a copy)."""
    view = kv.kv_caches[layer]
    rows = view.shape[0] // kv.max_num_blocks
    return view[block_id * rows : (block_id + 1) * rows].view(torch.int8)


def layer_groups(kv: KVCache) -> list[list[str]]:
    return [[n for n in g.layer_names if n in kv.kv_caches] for g in kv.config.kv_cache_groups]


def views_with_rows(kv: KVCache) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (v, v.shape[0] // kv.max_num_blocks) for n, v in kv.kv_caches.items()}


def granules_touched(ranges, granularity: int) -> set[int]:
    """Granule indices that byte ranges touch (a brute-force model of the committed set)."""
    return {i for start, end in ranges for i in range(start // granularity, (end - 1) // granularity + 1)}
