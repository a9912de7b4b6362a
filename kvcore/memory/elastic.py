"""Which bytes the first ``n`` blocks of an elastic cache need, and committing exactly those
(plan, strides and views stay those of all ``max_num_blocks`` blocks)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore._validate import as_int
from kvcore.memory.backing import reserve_backing
from kvcore.memory.backing_base import BackingMemory
from kvcore.memory.config import MAX_NUM_BLOCKS, KVCacheConfig
from kvcore.memory.layout import block_runs, merge_ranges, round_up

#: A layer view as allocated and how many of its rows form one manager block.
ViewRows = tuple[torch.Tensor, int]
Ranges = list[tuple[int, int]]


def block_byte_ranges(views: Mapping[str, ViewRows], num_blocks: int, granularity: int = 1) -> Ranges:
    """Byte ranges (from the allocation's start) that blocks ``[0, num_blocks)`` occupy: each
    run of block 0, from block 0's copy to the end of block ``n - 1``'s, rounded out to whole
    ``granularity``-byte granules."""
    g = granularity
    spans = []
    for view, rows in views.values():
        item = view.element_size()
        strides = [s * item for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, item, rows)
        base, block_stride = view.storage_offset() * item, strides[0] * rows
        last = base + (num_blocks - 1) * block_stride + run
        spans.extend((base + o, last + o) for o in offsets)
    return merge_ranges((start // g * g, round_up(end, g)) for start, end in spans)


def subtract_ranges(a: Ranges, b: Ranges) -> Ranges:
    """Bytes of the merged ranges ``a`` that are not in the merged ranges ``b``."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while start < end and k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


class ElasticMemory:
    """Backing memory committed for the first :attr:`num_blocks` blocks of a set of views."""

    def __init__(self, backing: BackingMemory) -> None:
        self.backing = backing
        self._views: dict[str, ViewRows] = {}
        self._fixed: Ranges = []
        self._committed: Ranges = []  # granule-aligned, merged
        self.num_blocks = 0

    def track(self, views: Mapping[str, ViewRows], fixed: Ranges = ()) -> None:
        """The layer views (over ``backing.tensor``) whose blocks decide what is committed, and
        byte ranges committed whatever the size (a separate state region)."""
        self._views, self._fixed = dict(views), list(fixed)

    committed_bytes = property(lambda self: sum(end - start for start, end in self._committed))

    def resize(self, num_blocks: int) -> None:
        """Commit or release granules so that exactly blocks ``[0, num_blocks)`` are backed (and the
        fixed ranges, a separate state region, stay backed), all or nothing: when a commit or
        release raises (Ctrl-C too) what changed is undone first."""
        backing, before, old = self.backing, self._committed, self.num_blocks
        g = backing.granularity
        fixed = [(start // g * g, round_up(end, g)) for start, end in self._fixed]
        want = merge_ranges([*block_byte_ranges(self._views, num_blocks, g), *fixed])
        gained = subtract_ranges(want, before)  # NOTE: a grow only gains, a shrink only loses
        ranges, step, undo = ((gained, backing.commit, backing.decommit) if gained else
                              (subtract_ranges(before, want), backing.decommit, backing.commit))
        done: Ranges = []  # NOTE: listed before the call; committing or releasing twice is harmless
        try:
            for start, end in ranges:
                done.append((start, end))
                step(start, end)
        except BaseException:
            # NOTE: should the undo fail too, only what is surely backed stays listed
            self._committed = subtract_ranges(before, merge_ranges(done))
            self.num_blocks = min(old, num_blocks)
            while done:
                undo(*done[-1])
                done.pop()
            self._committed, self.num_blocks = before, old
            raise
        self._committed, self.num_blocks = want, num_blocks


def checked_max_blocks(max_num_blocks: Any) -> int:
    max_num_blocks = as_int("max_num_blocks", max_num_blocks)
    if max_num_blocks < 2:
        raise ValueError(f"max_num_blocks must be at least 2 (block 0 is the null block), got {max_num_blocks}")
    if max_num_blocks > MAX_NUM_BLOCKS:
        raise ValueError(f"max_num_blocks={max_num_blocks:,} is more than the {MAX_NUM_BLOCKS:,} blocks a block pool "
                         "manages; use larger blocks (a bigger block_size) or fewer of them")
    return max_num_blocks


def checked_num_blocks(num_blocks: Any, max_num_blocks: int) -> int:
    """Blocks an elastic cache commits: an int from 2 to ``max_num_blocks``."""
    num_blocks = as_int("num_blocks", num_blocks)
    if not 2 <= num_blocks <= max_num_blocks:
        raise ValueError(f"num_blocks={num_blocks} must be between 2 and max_num_blocks={max_num_blocks}; "
                         "create the cache with a larger max_num_blocks or use fewer blocks")
    return num_blocks


def reserve_elastic(config: KVCacheConfig, device: torch.device) -> ElasticMemory:
    """Reserve the allocation of ``config`` (all its blocks) without committing any of it."""
    raw = [n for n, spec in config.layer_specs.items() if not spec.has_layer_views]
    if raw or not config.kv_cache_tensors:
        raise ValueError(f"an elastic cache needs every layer viewed by kvcore, but {raw or 'no layer'} "
                         "keeps a raw buffer (or the model keeps no cache); drop max_num_blocks")
    return ElasticMemory(reserve_backing(config.kv_cache_tensors[0].size, device))
