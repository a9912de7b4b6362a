"""A planned cache's memory in one pass: the backing (reserved when elastic), every layer's views
and scale views over it, and which of them each pool's zeroer (and an elastic backing) follows."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.memory.elastic import ElasticMemory, ViewRows, block_byte_ranges, reserve_elastic
from kvcore.memory.views import allocate_kv_cache, allocate_scale_views, with_kernel_pages


@attrs.frozen
class CacheMemory:
    """The views of one allocation: ``kv_caches`` as allocated, ``kernel_views`` as kernels read them,
    the per-token-head layers' ``scale_caches``, and (view, rows per block) of the paged views
    outside a separate state region (``paged``) and inside it (``states``)."""

    kv_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    kernel_views: dict[str, torch.Tensor] = attrs.field(repr=False)
    scale_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    paged: dict[str, ViewRows] = attrs.field(repr=False)
    states: dict[str, ViewRows] = attrs.field(repr=False)
    elastic: ElasticMemory | None = attrs.field(repr=False)


def allocate_cache_memory(config: KVCacheConfig, device: torch.device, kernel_block_sizes: list[int | None],
                          rows: Mapping[str, int], kernel_pages: Mapping[str, tuple[int, int]],
                          committed_blocks: int | None = None) -> CacheMemory:
    """Allocate ``config`` on ``device`` and view it (``rows``: kernel rows per manager block of each
    split layer; ``kernel_pages``: see :func:`with_kernel_pages`). ``committed_blocks`` not None:
    elastic, the first that many blocks committed."""
    elastic = None if committed_blocks is None else reserve_elastic(config, device)
    kv_caches = allocate_kv_cache(config, device, None, kernel_block_sizes,
                                  buffer=None if elastic is None else elastic.backing.tensor)
    view = next(iter(kv_caches.values()), None)
    raw = None if view is None else torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())
    scale_caches = {} if raw is None else allocate_scale_views(config, raw, kernel_block_sizes)
    kernel_views = with_kernel_pages(kv_caches, kernel_pages)
    # NOTE: scales are zeroed (and committed) with their blocks: the runs touch and merge.
    views = {**kv_caches, **{f"{name} (scales)": v for name, v in scale_caches.items()}}
    rows = {**rows, **{f"{name} (scales)": rows[name] for name in scale_caches if name in rows}}
    paged = {name: (views[name], rows[name]) for name in rows if name in views}
    states = {n: paged.pop(n) for n in config.state_region_layers() if n in paged}
    if elastic is not None:  # NOTE: an elastic cache keeps a separate state region committed
        elastic.track({name: (v, rows.get(name, v.shape[0] // config.num_blocks))
                       for name, v in views.items() if name not in states},
                      fixed=block_byte_ranges(states, config.num_state_blocks) if states else ())
        elastic.resize(committed_blocks)
    return CacheMemory(kv_caches, kernel_views, scale_caches, paged, states, elastic)
