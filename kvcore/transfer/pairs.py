"""Paired plans: run ``i`` of source block ``s`` copied to run ``i`` of destination block
``d`` (patterns of equal run lengths), or (state, head) rows for a peer with fewer KV heads."""

from __future__ import annotations

import itertools

import attrs
import torch

from kvcore.transfer.descriptor import LayerDescriptor
from kvcore.transfer.regions import BlockPattern


@attrs.frozen
class PairedRuns:
    """Copies of ``lengths[i]`` bytes from ``src_offsets[i]`` to ``dst_offsets[i]`` (CPU int64)."""

    src_allocation: int
    dst_allocation: int
    src_offsets: torch.Tensor = attrs.field(eq=False, repr=False)
    dst_offsets: torch.Tensor = attrs.field(eq=False, repr=False)
    lengths: torch.Tensor = attrs.field(eq=False, repr=False)

    @property
    def num_runs(self) -> int:
        return self.lengths.numel()

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def packed_patterns(patterns: tuple[BlockPattern, ...]) -> tuple[BlockPattern, ...]:
    """Patterns storing each block's runs back to back in one slot (the host mirror's)."""
    slot, offset, out = sum(p.block_bytes for p in patterns), 0, []
    for p in patterns:
        starts = tuple(itertools.accumulate(p.lengths[:-1], initial=offset))
        out.append(BlockPattern(0, slot, starts, p.lengths))
        offset += p.block_bytes
    return tuple(out)


def structure_mismatch(src: tuple[BlockPattern, ...], dst: tuple[BlockPattern, ...]) -> str | None:
    """Why the runs of ``src`` blocks cannot be copied onto ``dst`` blocks one to one, or None."""
    if len(src) != len(dst):
        return f"blocks are split over {len(src)} vs {len(dst)} (allocation, stride) classes"
    for i, (a, b) in enumerate(zip(src, dst)):
        if a.lengths != b.lengths:
            return (f"a block's runs differ (class {i}: {len(a.lengths)} runs of {a.block_bytes} "
                    f"bytes vs {len(b.lengths)} runs of {b.block_bytes} bytes)")
    return None


def merge_pairs(src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor):
    """Merge copies adjacent on both sides; returns sorted (src, dst, lengths)."""
    if not src.numel():
        return src, dst, lengths
    src, order = torch.sort(src, stable=True)
    dst, lengths = dst[order], lengths[order]
    new = torch.ones_like(src, dtype=torch.bool)
    new[1:] = (src[1:] != src[:-1] + lengths[:-1]) | (dst[1:] != dst[:-1] + lengths[:-1])
    run = torch.cumsum(new, 0) - 1
    merged = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run, lengths)
    return src[new], dst[new], merged


def pair_runs(src_patterns: tuple[BlockPattern, ...], src_ids: torch.Tensor, dst_patterns: tuple[BlockPattern, ...],
              dst_ids: torch.Tensor) -> list[PairedRuns]:
    """The copies that move blocks ``src_ids`` onto ``dst_ids`` (checked ids), merged per pair
    of allocations."""
    reason = structure_mismatch(src_patterns, dst_patterns)
    if reason is not None:
        raise ValueError(f"source and destination blocks are laid out differently: {reason}")
    parts: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}
    for a, b in zip(src_patterns, dst_patterns):
        src, lengths = a.runs(src_ids)
        parts.setdefault((a.allocation, b.allocation), []).append((src, b.runs(dst_ids)[0], lengths))
    return [PairedRuns(*allocs, *merge_pairs(*(torch.cat(x) for x in zip(*runs))))
            for allocs, runs in sorted(parts.items())]


def head_patterns(layers: tuple[LayerDescriptor, ...], head0: int, num_heads: int):
    """One pattern per layer: the (state, head) rows of heads ``head0...`` of a block."""
    patterns = []
    for layer in layers:
        s, states = layer.byte_strides, layer.shape[2]
        t = torch.arange(layer.rows_per_block * states)
        rows = layer.offset + (t // states) * s[0] + (t % states) * s[2]
        starts = rows[:, None] + (head0 + torch.arange(num_heads))[None, :] * s[1]
        lengths = (layer.content.content_bytes,) * starts.numel()
        patterns.append(BlockPattern(layer.allocation, layer.manager_block_stride,
                                     tuple(starts.flatten().tolist()), lengths))
    return tuple(patterns)
