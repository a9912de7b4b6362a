"""Transfer plans: the exact contiguous byte runs of a set of manager blocks.

Each layer's view is reduced to a *block pattern*: the runs one manager block
occupies, relative to block 0, which repeat every ``manager_block_stride``
bytes. Layers of one stride share a pattern (their runs merge where they
touch: all layers of a block in a block-outermost layout become one run). A
plan places the pattern at every listed block and merges the union into the
fewest runs, vectorized on CPU tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import torch

from kvcore.memory.layout import block_runs
from kvcore.transfer.descriptor import KVCacheDescriptor, LayerDescriptor
from kvcore.transfer.ids import block_id_tensor


@attrs.frozen(order=True)
class Region:
    """``length`` bytes at byte ``offset`` of allocation ``allocation``."""

    allocation: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@attrs.frozen
class BlockPattern:
    """Runs ``[starts[i] + b * block_stride, ... + lengths[i])`` of block ``b`` in one allocation."""

    allocation: int
    block_stride: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return sum(self.lengths)


def _union(starts: list[int], lengths: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    merged: list[list[int]] = []
    for start, length in sorted(zip(starts, lengths)):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length])
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged)


def select_layers(
    descriptor: KVCacheDescriptor, group_ids: Sequence[int], layers: Sequence[str] | None
) -> list[LayerDescriptor]:
    """The layers with views of ``group_ids`` (all, or those named in ``layers``)."""
    groups = [descriptor.group(g) for g in group_ids]
    available = [layer for group in groups for layer in group.layers]
    if layers is None:
        return available
    if isinstance(layers, str):
        raise TypeError(f"layers must be a list of layer names, got the string {layers!r}")
    by_name = {layer.name: layer for layer in available}
    unknown = [name for name in layers if name not in by_name]
    if unknown:
        raise ValueError(
            f"layers {unknown} have no cache view in group(s) {list(group_ids)}; "
            f"pick from {sorted(by_name)}"
        )
    return [by_name[name] for name in dict.fromkeys(layers)]


@functools.lru_cache(maxsize=256)
def block_patterns(
    descriptor: KVCacheDescriptor, group_ids: tuple[int, ...], layers: tuple[str, ...] | None
) -> tuple[BlockPattern, ...]:
    """One merged pattern per (allocation, manager block stride) of the selected layers."""
    pieces: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for layer in select_layers(descriptor, group_ids, layers):
        offsets, run = block_runs(layer.shape, layer.byte_strides, layer.itemsize, layer.rows_per_block)
        starts, lengths = pieces.setdefault((layer.allocation, layer.manager_block_stride), ([], []))
        starts.extend(layer.offset + o for o in offsets)
        lengths.extend([run] * len(offsets))
    return tuple(
        BlockPattern(alloc, stride, *_union(starts, lengths))
        for (alloc, stride), (starts, lengths) in sorted(pieces.items())
    )


def pattern_runs(pattern: BlockPattern, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts and lengths of ``pattern`` placed at every block of ``ids``, block-major."""
    starts = torch.tensor(pattern.starts, dtype=torch.int64)
    lengths = torch.tensor(pattern.lengths, dtype=torch.int64)
    placed = (ids[:, None] * pattern.block_stride + starts[None, :]).reshape(-1)
    return placed, lengths.repeat(ids.numel())


def merge_runs(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of runs as the fewest sorted, disjoint runs (touching runs merge)."""
    if not starts.numel():
        return starts, lengths
    starts, order = torch.sort(starts, stable=True)
    ends = torch.cummax(starts + lengths[order], 0).values
    new = torch.ones_like(starts, dtype=torch.bool)
    new[1:] = starts[1:] > ends[:-1]
    first = torch.nonzero(new).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([starts.numel() - 1])])
    return starts[first], ends[last] - starts[first]


def plan_transfer(
    descriptor: KVCacheDescriptor,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    group_id: int = 0,
    layers: Sequence[str] | None = None,
) -> list[Region]:
    """The fewest contiguous runs covering exactly the bytes of ``block_ids``.

    Covers every byte the views of group ``group_id``'s layers (all, or those
    in ``layers``) address for the listed manager blocks, and nothing else
    (page padding excluded). Runs are sorted, disjoint and never touch.
    Ids must be integers in ``[1, num_blocks)`` in a list, tuple or integer
    tensor (``ValueError`` otherwise, dicts and sets included): block 0 is the
    null block, which holds no data and is never moved.
    """
    if not isinstance(descriptor, KVCacheDescriptor):
        raise TypeError(f"plan_transfer needs a KVCacheDescriptor, got {type(descriptor).__name__}")
    descriptor.group(group_id)
    ids = block_id_tensor(block_ids, descriptor.num_blocks, null_ok=False)
    patterns = block_patterns(descriptor, (group_id,), None if layers is None else tuple(layers))
    regions = []
    for alloc in sorted({p.allocation for p in patterns}):
        placed = [pattern_runs(p, ids) for p in patterns if p.allocation == alloc]
        starts, lengths = merge_runs(torch.cat([s for s, _ in placed]), torch.cat([n for _, n in placed]))
        regions.extend(Region(alloc, s, n) for s, n in zip(starts.tolist(), lengths.tolist()))
    return regions
