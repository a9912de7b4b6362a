"""Transfer plans: the exact byte runs of manager blocks (a *block pattern* placed at every
listed block, runs merged, on CPU tensors), and the checks of block ids."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence, Set
from typing import Any

import attrs
import torch

from kvcore.memory.layout import block_runs
from kvcore.transfer.descriptor import KVCacheDescriptor


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
    """Runs ``[starts[i] + b * block_stride, ... + lengths[i])`` of block ``b``."""

    allocation: int
    block_stride: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return sum(self.lengths)

    def runs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Starts and lengths of the pattern placed at every block of ``ids``, block-major."""
        starts = torch.tensor(self.starts, dtype=torch.int64)
        placed = (ids[:, None] * self.block_stride + starts[None, :]).reshape(-1)
        return placed, torch.tensor(self.lengths, dtype=torch.int64).repeat(ids.numel())


def _bad_id(value: Any, num_blocks: int, what: str, low: int) -> ValueError:
    null = " (block 0 is the null block and holds no data)" if low else ""
    return ValueError(f"{what} {value!r} is not an integer in [{low}, {num_blocks}); pass manager "
                      f"block ids from the block pool{null}; nothing was transferred")


def _plural(what: str) -> str:
    noun, sep, rest = what.partition(" of ")  # "block id of peer 'x'" -> "block ids of peer 'x'"
    return f"{noun}s{sep}{rest}"


def block_id_tensor(block_ids: Any, num_blocks: int, what: str = "block id", null_ok: bool = True) -> torch.Tensor:
    """Ints, a sequence of ints or an integer tensor, each in ``[0 or 1, num_blocks)``, as int64."""
    low = 0 if null_ok else 1
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype == torch.bool or block_ids.is_floating_point() or block_ids.is_complex():
            raise ValueError(f"{_plural(what)} must be an integer tensor, got {block_ids.dtype}; pass int32/int64 ids")
        ids = block_ids.detach().reshape(-1).to("cpu", torch.int64)
        bad = ids[(ids < low) | (ids >= num_blocks)]
        if bad.numel():
            raise _bad_id(int(bad[0]), num_blocks, what, low)
        return ids
    if isinstance(block_ids, (str, bytes, Mapping, Set)) or block_ids is None:
        raise ValueError(f"{_plural(what)} must be a sequence of integers (a list, tuple or "
                         f"integer tensor), got {block_ids!r}; nothing was transferred")
    try:
        items = list([block_ids] if isinstance(block_ids, int) else block_ids)
    except TypeError:
        raise _bad_id(block_ids, num_blocks, what, low) from None
    for value in items:
        index = None if "bool" in type(value).__name__ else getattr(value, "__index__", None)
        if index is None or not low <= index() < num_blocks:
            raise _bad_id(value, num_blocks, what, low)
    return torch.tensor([operator.index(v) for v in items], dtype=torch.int64)


def paired_ids(first: tuple, second: tuple, *, first_is_src: bool) -> tuple[torch.Tensor, ...]:
    """Checked ids of a transfer's two sides, each ``(ids, num_blocks, what, null_ok)``: one
    source per destination and no destination twice; returned in argument order."""
    src, dst = (first, second) if first_is_src else (second, first)
    src_ids, dst_ids = block_id_tensor(*src), block_id_tensor(*dst)
    if src_ids.numel() != dst_ids.numel():
        src_n = src[2] if src_ids.numel() == 1 else _plural(src[2])
        dst_n = dst[2] if dst_ids.numel() == 1 else _plural(dst[2])
        raise ValueError(f"got {src_ids.numel()} {src_n} and {dst_ids.numel()} {dst_n}; pass one "
                         f"{dst[2]} per {src[2]} (nothing was transferred)")
    values, counts = torch.unique(dst_ids, return_counts=True)
    if values.numel() != dst_ids.numel():
        raise ValueError(f"{dst[2]} {int(values[counts > 1][0])} is listed twice; each destination "
                         "block takes one source block (nothing was transferred)")
    return (src_ids, dst_ids) if first_is_src else (dst_ids, src_ids)


def merge_runs(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of runs as the fewest sorted, disjoint runs (touching runs merge)."""
    if not starts.numel():
        return starts, lengths
    starts, order = torch.sort(starts, stable=True)
    ends = torch.cummax(starts + lengths[order], 0).values
    new = torch.ones_like(starts, dtype=torch.bool)
    new[1:] = starts[1:] > ends[:-1]
    last = torch.cat([torch.nonzero(new).flatten()[1:] - 1, torch.tensor([starts.numel() - 1])])
    return starts[new], ends[last] - starts[new]


@functools.lru_cache(maxsize=256)
def block_patterns(
    descriptor: KVCacheDescriptor, group_ids: tuple[int, ...], layers: tuple[str, ...] | None
) -> tuple[BlockPattern, ...]:
    """One merged pattern per (allocation, manager block stride) of the layers with views of
    ``group_ids`` (all, or those named in ``layers``)."""
    chosen = [layer for g in group_ids for layer in descriptor.group(g).layers]
    if layers is not None:
        by_name = {layer.name: layer for layer in chosen}
        unknown = [name for name in layers if name not in by_name]
        if unknown:
            raise ValueError(f"layers {unknown} have no cache view in group(s) {list(group_ids)}; "
                             f"pick from {sorted(by_name)}")
        chosen = [by_name[name] for name in dict.fromkeys(layers)]
    pieces: dict[tuple[int, int], list[list[int]]] = {}
    for layer in chosen:
        key = (layer.allocation, layer.manager_block_stride)
        starts, lengths = pieces.setdefault(key, [[], []])
        views = [(layer.offset, layer.shape, layer.byte_strides, layer.itemsize)]
        if (scales := layer.scales) is not None:  # NOTE: a per-token-head page: its scales move with it
            views.append((scales.offset, scales.shape, scales.byte_strides, 4))
        for offset, shape, strides, itemsize in views:
            offsets, run = block_runs(shape, strides, itemsize, layer.rows_per_block)
            starts.extend(offset + o for o in offsets)
            lengths.extend([run] * len(offsets))
    patterns = []
    for (alloc, stride), runs in sorted(pieces.items()):
        starts, lengths = (tuple(t.tolist()) for t in merge_runs(*map(torch.tensor, runs)))
        patterns.append(BlockPattern(alloc, stride, starts, lengths))
    return tuple(patterns)


def group_selection(descriptor: KVCacheDescriptor, group_id: int | None) -> tuple[int, ...]:
    """Group ids one call moves: ``group_id``, or every group with cache views whose block ids
    are the descriptor's (a separate state region's groups are moved by naming them)."""
    if group_id is None:
        return tuple(g.group_id for g in descriptor.groups if g.layers and g.num_blocks is None)
    if not descriptor.group(group_id).layers:
        raise ValueError(f"KV cache group {group_id} has no cache pages to move")
    return (group_id,)


def whole_block_patterns(descriptor: KVCacheDescriptor, group_ids: tuple[int, ...]) -> tuple[BlockPattern, ...]:
    """Patterns of all selected groups; refuses groups whose blocks repeat at other strides."""
    patterns = block_patterns(descriptor, group_ids, None)
    strides = sorted({p.block_stride for p in patterns})
    if len(strides) > 1:
        raise ValueError(f"the KV cache groups store blocks at different strides ({strides} bytes), so a "
                         "block id means different bytes in each; pass group_id= to move one group's blocks")
    return patterns


def plan_transfer(descriptor: KVCacheDescriptor, block_ids: Sequence[int] | torch.Tensor, *, group_id: int = 0,
                  layers: Sequence[str] | None = None) -> list[Region]:
    """The fewest contiguous runs covering exactly the bytes of manager blocks ``block_ids``.

    Every byte the views of group ``group_id``'s layers (all, or ``layers``) address for
    those blocks, page padding excluded; sorted, disjoint, never touching. Ids are
    integers in ``[1, num_blocks)`` (block 0 is the null block; a separate state region's
    group counts its own blocks), else ``ValueError``.
    """
    if not isinstance(descriptor, KVCacheDescriptor):
        raise TypeError(f"plan_transfer needs a KVCacheDescriptor, got {type(descriptor).__name__}")
    if isinstance(layers, (str, bytes)):
        raise TypeError(f"plan_transfer's layers must be a list of layer names, got the string "
                        f"{layers!r}; pass [{layers!r}] to move that one layer")
    ids = block_id_tensor(block_ids, descriptor.num_blocks_of(group_id), null_ok=False)
    patterns = block_patterns(descriptor, (group_id,), None if layers is None else tuple(layers))
    regions = []
    for alloc in sorted({p.allocation for p in patterns}):
        placed = [p.runs(ids) for p in patterns if p.allocation == alloc]
        starts, lengths = merge_runs(*(torch.cat(x) for x in zip(*placed)))
        regions.extend(Region(alloc, s, n) for s, n in zip(starts.tolist(), lengths.tolist()))
    return regions
