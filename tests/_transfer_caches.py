"""Small KV caches of every shape the transfer tests cover (layouts, splitting, hybrid, state)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from kvcore import (
    FullAttentionSpec,
    KVCache,
    KVCacheLayout,
    MambaSpec,
    SlidingWindowSpec,
    get_plugin_manager,
    hookimpl,
)
from kvcore_torch.backend import TorchAttentionBackend

LAYOUTS = [layout.name for layout in KVCacheLayout]
# kind -> layouts it can be built in
KINDS = {
    "uniform": LAYOUTS,
    "hybrid": LAYOUTS,
    "state": ["LBNHC", "LBHNC", "BLNHC", "BLHNC"],
    "split": ["LBNHC", "LBHNC"],
}


class Fixed8Backend(TorchAttentionBackend):
    """The torch backend, but taking only 8-token kernel blocks."""

    name: ClassVar[str] = "transfer-fixed8"


class Fixed8Plugin:
    @hookimpl
    def kvcore_register_backends(self, register):
        register(Fixed8Backend)

    @hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return [8] if backend is Fixed8Backend else None


@functools.cache
def plugin_manager():
    pm = get_plugin_manager()
    pm.register(Fixed8Plugin(), name="transfer-fixed8-plugin")
    return pm


def layer_specs(kind: str, dtype: torch.dtype = torch.float16) -> dict:
    if kind == "uniform":
        return {f"layers.{i}.attn": FullAttentionSpec(16, 2, 8, dtype) for i in range(3)}
    if kind == "split":
        return {f"layers.{i}.attn": FullAttentionSpec(32, 2, 8, dtype) for i in range(2)}
    if kind == "hybrid":
        return {
            f"layers.{i}.attn": (SlidingWindowSpec(16, 2, 8, dtype, sliding_window=32) if i % 2
                                 else FullAttentionSpec(16, 2, 8, dtype))
            for i in range(4)
        }
    if kind == "state":
        mamba = MambaSpec(16, [(4, 8), (3, 2)], [torch.float32, torch.float16])
        return {"layers.0.mamba": mamba, "layers.1.attn": FullAttentionSpec(16, 2, 8, torch.float32),
                "layers.2.mamba": mamba}
    raise ValueError(kind)


def make_cache(kind: str, layout: str, num_blocks: int = 7, device: str = "cpu", dtype=torch.float16) -> KVCache:
    specs = layer_specs(kind, dtype)
    # NOTE: classes, not names, so no installed entry point is needed (the GPU machine has none).
    backend = Fixed8Backend if kind == "split" else TorchAttentionBackend
    return KVCache.create(
        specs, {n: backend for n, s in specs.items() if not isinstance(s, MambaSpec)},
        device=device, layout=layout, num_blocks=num_blocks, max_num_seqs=2, max_model_len=64,
        plugin_manager=plugin_manager(),
    )


@functools.cache
def cached_cache(kind: str, layout: str) -> KVCache:
    return make_cache(kind, layout)


def raw_buffer(kv: KVCache) -> torch.Tensor:
    """The whole backing allocation as a 1-D int8 tensor."""
    view = next(iter(kv.kv_caches.values()))
    return torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def block_rows(kv: KVCache, layer: str, block_ids: list[int]) -> torch.Tensor:
    """View rows (of ``kv.kv_caches[layer]``) that make up the manager blocks."""
    view = kv.kv_caches[layer]
    ratio = view.shape[0] // kv.num_blocks
    ids = torch.tensor(block_ids, dtype=torch.int64)[:, None] * ratio
    return (ids + torch.arange(ratio)).flatten()


def brute_force_bytes(kv: KVCache, block_ids: list[int], layers: list[str]) -> torch.Tensor:
    """Bool mask of the allocation: bytes the views of ``layers`` address for ``block_ids``."""
    raw = raw_buffer(kv)
    saved = raw.clone()
    raw.zero_()
    for name in layers:
        view = kv.kv_caches[name]
        marks = view.view(_SAME_SIZE_INT[view.element_size()])
        marks[block_rows(kv, name, block_ids)] = -1
    mask = raw != 0
    raw.copy_(saved)
    return mask
