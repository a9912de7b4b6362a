"""A KV cache's separate state region (``separate_state_pages``): the planner options that make
it, and its own block pool and zeroer over the state groups' views."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheConfig, is_state_spec
from kvcore.memory.elastic import Ranges, ViewRows, block_byte_ranges
from kvcore.memory.planner import group_layers
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.settings import Settings
from kvcore.specs import KVCacheSpec


def state_region_options(
    specs: Mapping[str, KVCacheSpec], separate_state_pages: Any, num_state_blocks: Any,
    max_num_seqs: int,
) -> dict[str, Any]:
    """``plan_kv_cache``'s keywords for the region (none for a plan without one); the region
    holds ``num_state_blocks`` blocks, by default one per sequence and state group plus the null
    block."""
    if not isinstance(separate_state_pages, bool):
        raise TypeError(f"separate_state_pages must be True or False, got {separate_state_pages!r}")
    if not separate_state_pages:
        if num_state_blocks is not None:
            raise ValueError(
                f"num_state_blocks={num_state_blocks!r} sizes the separate state region; pass "
                "separate_state_pages=True with it, or drop it"
            )
        return {}
    states = {n: s for n, s in specs.items() if is_state_spec(s)}
    if not states:
        return {}  # NOTE: no state cache: the plan is the plain one
    if num_state_blocks is None:
        num_state_blocks = max_num_seqs * len(group_layers(states)) + 1
    return {"separate_state_pages": True, "num_state_blocks": positive_int("num_state_blocks", num_state_blocks)}


@attrs.frozen
class StateRegion:
    """The region's pool and zeroer (None without a region), its layers' views, and the bytes it
    occupies (an elastic cache keeps them committed)."""

    pool: BlockPool | None = None
    zeroer: KVBlockZeroer | None = None
    views: dict[str, ViewRows] = attrs.field(factory=dict, repr=False)
    byte_ranges: Ranges = attrs.field(factory=list)


def state_region(
    config: KVCacheConfig, views: dict[str, ViewRows], device: torch.device, settings: Settings,
    enable_caching: bool,
) -> StateRegion:
    """The state region of ``config``, whose layers' entries it takes out of ``views`` (layer ->
    ``(view as allocated, rows per block)``), leaving those of the other pool."""
    if not config.separate_state_pages:
        return StateRegion()
    names = {n for i, g in enumerate(config.kv_cache_groups) if config.in_state_region(i) for n in g.layer_names}
    mine = {name: views.pop(name) for name in list(views) if name in names}
    blocks = config.num_state_blocks
    zeroer = KVBlockZeroer.from_views(device, mine, blocks, settings=settings)
    pool = BlockPool(blocks, enable_caching=enable_caching)
    return StateRegion(pool, zeroer, mine, block_byte_ranges(mine, blocks))
