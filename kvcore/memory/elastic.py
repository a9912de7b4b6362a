"""Which bytes of the one allocation the first ``n`` blocks need, and committing exactly those.

The plan, strides and views of an elastic cache are those of its
``max_num_blocks`` blocks; only the memory behind them follows the current
block count. What one committed granule holds is decided by the layout
alone, read off the views: a block-outermost layout keeps blocks ``[0, n)``
in one prefix of the allocation (it grows by whole blocks at the end); a
layer-compact one keeps one run per layer (per layer and head in LHBNC),
each reserved for every block, and the first ``n`` blocks of each run are
committed (a grow maps one granule per run it reaches).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from kvcore.memory.backing import BackingMemory
from kvcore.memory.runs import block_runs

#: A layer view as allocated and how many of its rows form one manager block.
ViewRows = tuple[torch.Tensor, int]


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ranges covering the same bytes; touching ranges are joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def block_byte_ranges(views: Mapping[str, ViewRows], num_blocks: int) -> list[tuple[int, int]]:
    """Byte ranges (from the allocation's start) that blocks ``[0, num_blocks)`` occupy in ``views``.

    Per layer, each contiguous run of block 0 (one per head in LHBNC, see
    :func:`~kvcore.memory.runs.block_runs`) repeats at the manager block
    stride; blocks ``[0, n)`` of that run span from block 0's copy to the end
    of block ``n - 1``'s. What lies between two blocks of one run is other
    layers' or padding bytes of blocks below ``n``, never a higher block's.
    """
    spans = []
    for view, rows in views.values():
        item = view.element_size()
        strides = [s * item for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, item, rows)
        base, block_stride = view.storage_offset() * item, strides[0] * rows
        last = base + (num_blocks - 1) * block_stride + run
        spans.extend((base + o, last + o) for o in offsets)
    return merge_ranges(spans)


def granules_of(ranges: Iterable[tuple[int, int]], granularity: int) -> set[int]:
    """Offsets of the granules that ``ranges`` touch."""
    out: set[int] = set()
    for start, end in ranges:
        out.update(range(start // granularity * granularity, end, granularity))
    return out


def granule_runs(offsets: Iterable[int], granularity: int) -> list[tuple[int, int]]:
    """Granule offsets as merged ``[start, end)`` byte ranges."""
    return merge_ranges((o, o + granularity) for o in offsets)


class ElasticMemory:
    """Backing memory committed for the first :attr:`num_blocks` blocks of a set of views."""

    def __init__(self, backing: BackingMemory) -> None:
        self.backing = backing
        self._views: dict[str, ViewRows] = {}
        self._granules: set[int] = set()
        self.num_blocks = 0

    def track(self, views: Mapping[str, ViewRows]) -> None:
        """The layer views (over :attr:`backing`'s tensor) whose blocks decide what is committed."""
        self._views = dict(views)

    @property
    def committed_bytes(self) -> int:
        return len(self._granules) * self.backing.granularity

    def granules_for(self, num_blocks: int) -> set[int]:
        return granules_of(block_byte_ranges(self._views, num_blocks), self.backing.granularity)

    def resize(self, num_blocks: int) -> None:
        """Commit or release granules so that exactly blocks ``[0, num_blocks)`` are backed.

        All or nothing: a grow that fails part-way gives back what it
        committed and raises; nothing changes.
        """
        g, backing = self.backing.granularity, self.backing
        want = self.granules_for(num_blocks)
        added: list[tuple[int, int]] = []
        try:
            for start, end in granule_runs(want - self._granules, g):
                backing.commit(start, end)
                added.append((start, end))
        except BaseException:
            for start, end in added:
                backing.decommit(start, end)
            raise
        for start, end in granule_runs(self._granules - want, g):
            backing.decommit(start, end)
        self._granules = want
        self.num_blocks = num_blocks
