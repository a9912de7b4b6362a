"""A KV cache's separate state region (``separate_state_pages``): the planner's keywords for it,
and its own block pool and zeroer over the state groups' views."""

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


def state_region_options(specs: Mapping[str, KVCacheSpec], separate: Any, num_state_blocks: Any,
                         max_num_seqs: int, prefix_caching: bool = False) -> dict[str, Any]:
    """``plan_kv_cache``'s keywords (none without a region); by default the region holds a slot
    per sequence and state group, as many checkpoints with prefix caching, and the null block."""
    if not isinstance(separate, bool):
        raise TypeError(f"separate_state_pages must be True or False, got {separate!r}")
    if num_state_blocks is not None and not separate:
        raise ValueError(f"num_state_blocks={num_state_blocks!r} sizes the separate state region; pass "
                         "separate_state_pages=True with it, or drop it")
    states = {n: s for n, s in specs.items() if is_state_spec(s)}
    if not separate or not states:
        return {}
    if num_state_blocks is None:
        num_state_blocks = (2 if prefix_caching else 1) * max_num_seqs * len(group_layers(states)) + 1
    return {"separate_state_pages": True, "num_state_blocks": positive_int("num_state_blocks", num_state_blocks)}


@attrs.frozen
class StateRegion:
    """The region's pool and zeroer (None without one), its layers' views and its bytes (which an
    elastic cache keeps committed)."""

    pool: BlockPool | None = None
    zeroer: KVBlockZeroer | None = None
    views: dict[str, ViewRows] = attrs.field(factory=dict, repr=False)
    byte_ranges: Ranges = attrs.field(factory=list)


def state_region(config: KVCacheConfig, views: dict[str, ViewRows], device: torch.device, settings: Settings,
                 enable_caching: bool) -> StateRegion:
    """The state region of ``config``; takes its layers' ``(view, rows per block)`` out of ``views``."""
    if not config.separate_state_pages:
        return StateRegion()
    groups = config.kv_cache_groups
    names = {n for i, g in enumerate(groups) if config.in_state_region(i) for n in g.layer_names}
    mine = {name: views.pop(name) for name in list(views) if name in names}
    blocks = config.num_state_blocks
    zeroer = KVBlockZeroer.from_views(device, mine, blocks, settings=settings)
    return StateRegion(BlockPool(blocks, enable_caching=enable_caching), zeroer, mine, block_byte_ranges(mine, blocks))
