"""A KV cache's separate state region (``separate_state_pages``): its own block pool and zeroer
over the state groups' views."""

from __future__ import annotations

import attrs
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.memory.elastic import Ranges, ViewRows, block_byte_ranges
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.settings import Settings


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
