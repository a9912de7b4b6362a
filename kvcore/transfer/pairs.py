"""Paired plans: copies from the runs of source blocks to the runs of destination blocks.

Two caches of one structure (a peer of the same layout and specs, or the packed host
mirror) have patterns of equal run lengths, so run ``i`` of source block ``s`` goes to run
``i`` of destination block ``d``. A peer with fewer KV heads pairs (state, head) rows.
"""

from __future__ import annotations

import itertools

import attrs
import torch

from kvcore.transfer.descriptor import KVCacheDescriptor, LayerDescriptor
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


def _merged(parts: list[tuple]) -> list[PairedRuns]:
    """``(src alloc, dst alloc, src, dst, lengths)`` copies merged per pair of allocations."""
    out = []
    for sa, da in sorted({p[:2] for p in parts}):
        chosen = [p[2:] for p in parts if p[:2] == (sa, da)]
        out.append(PairedRuns(sa, da, *merge_pairs(*(torch.cat(x) for x in zip(*chosen)))))
    return out


def pair_runs(
    src_patterns: tuple[BlockPattern, ...], src_ids: torch.Tensor,
    dst_patterns: tuple[BlockPattern, ...], dst_ids: torch.Tensor,
) -> list[PairedRuns]:
    """The copies that move blocks ``src_ids`` onto ``dst_ids`` (checked ids)."""
    reason = structure_mismatch(src_patterns, dst_patterns)
    if reason is not None:
        raise ValueError(f"source and destination blocks are laid out differently: {reason}")
    parts = []
    for a, b in zip(src_patterns, dst_patterns):
        src, lengths = a.runs(src_ids)
        parts.append((a.allocation, b.allocation, src, b.runs(dst_ids)[0], lengths))
    return _merged(parts)


def _head_rows(layer: LayerDescriptor, ids: torch.Tensor, head0: int, num_heads: int):
    """Start byte of every (block, state, head) row, block-major, for heads ``head0...``."""
    s, states = layer.byte_strides, layer.shape[2]
    t = torch.arange(layer.rows_per_block * states)
    within = (t // states) * s[0] + (t % states) * s[2]
    heads = (head0 + torch.arange(num_heads)) * s[1]
    blocks = layer.offset + ids * layer.manager_block_stride
    return (blocks[:, None, None] + within[None, :, None] + heads[None, None, :]).reshape(-1)


def pair_head_rows(
    src: KVCacheDescriptor, src_ids: torch.Tensor, src_head0: int,
    dst: KVCacheDescriptor, dst_ids: torch.Tensor, dst_head0: int,
    *, group_id: int, num_heads: int,
) -> list[PairedRuns]:
    """Copies moving heads ``src_head0...`` of ``src`` blocks onto heads ``dst_head0...``."""
    parts = []
    for ls, ld in zip(src.group(group_id).layers, dst.group(group_id).layers):
        s = _head_rows(ls, src_ids, src_head0, num_heads)
        d = _head_rows(ld, dst_ids, dst_head0, num_heads)
        lengths = torch.full_like(s, ls.content.content_bytes)
        parts.append((ls.allocation, ld.allocation, s, d, lengths))
    return _merged(parts)
