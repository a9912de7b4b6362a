"""Paired plans: byte runs of source blocks matched to the runs of destination blocks.

Two caches of one structure (a peer with the same layout and specs, or the
packed host mirror) have patterns of equal run lengths, so piece ``i`` of
source block ``s`` goes to piece ``i`` of destination block ``d``. Pieces that
are adjacent on both sides merge into one copy (consecutive blocks of a
block-outermost layout become one run).
"""

from __future__ import annotations

import attrs
import torch

from kvcore.transfer.plan import BlockPattern, pattern_runs


@attrs.frozen
class PairedRuns:
    """Copies ``lengths[i]`` bytes from ``src_offsets[i]`` to ``dst_offsets[i]`` (CPU int64 tensors)."""

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


def packed_patterns(patterns: tuple[BlockPattern, ...]) -> tuple[tuple[BlockPattern, ...], int]:
    """Host-side patterns that store each block's pieces back to back, and the slot size."""
    slot = sum(p.block_bytes for p in patterns)
    out, offset = [], 0
    for p in patterns:
        starts = []
        for length in p.lengths:
            starts.append(offset)
            offset += length
        out.append(BlockPattern(0, slot, tuple(starts), p.lengths))
    return tuple(out), slot


def structure_mismatch(src: tuple[BlockPattern, ...], dst: tuple[BlockPattern, ...]) -> str | None:
    """Why the runs of ``src`` blocks cannot be copied onto ``dst`` blocks one to one, or None."""
    if len(src) != len(dst):
        return f"blocks are split over {len(src)} vs {len(dst)} (allocation, stride) classes"
    for i, (a, b) in enumerate(zip(src, dst)):
        if a.lengths != b.lengths:
            return (
                f"a block's runs differ (class {i}: {len(a.lengths)} runs of {a.block_bytes} "
                f"bytes vs {len(b.lengths)} runs of {b.block_bytes} bytes)"
            )
    return None


def merge_pairs(src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor):
    """Merge pieces adjacent on both sides; returns sorted (src, dst, lengths)."""
    if not src.numel():
        return src, dst, lengths
    src, order = torch.sort(src, stable=True)
    dst, lengths = dst[order], lengths[order]
    new = torch.ones_like(src, dtype=torch.bool)
    new[1:] = (src[1:] != src[:-1] + lengths[:-1]) | (dst[1:] != dst[:-1] + lengths[:-1])
    run = torch.cumsum(new, 0) - 1
    merged = torch.zeros(int(run[-1]) + 1, dtype=torch.int64).index_add_(0, run, lengths)
    return src[new], dst[new], merged


def pair_runs(
    src_patterns: tuple[BlockPattern, ...],
    src_ids: torch.Tensor,
    dst_patterns: tuple[BlockPattern, ...],
    dst_ids: torch.Tensor,
) -> list[PairedRuns]:
    """The copies that move blocks ``src_ids`` onto ``dst_ids`` (validated, equal lengths)."""
    reason = structure_mismatch(src_patterns, dst_patterns)
    if reason is not None:
        raise ValueError(f"source and destination blocks are laid out differently: {reason}")
    grouped: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for a, b in zip(src_patterns, dst_patterns):
        s, n = pattern_runs(a, src_ids)
        d, _ = pattern_runs(b, dst_ids)
        grouped.setdefault((a.allocation, b.allocation), []).append((s, d, n))
    out = []
    for (sa, da), parts in sorted(grouped.items()):
        s, d, n = merge_pairs(*(torch.cat(x) for x in zip(*parts)))
        out.append(PairedRuns(sa, da, s, d, n))
    return out
