"""Head slices: pair the (head, state) rows of some KV heads of a peer's blocks with local rows.

A decode rank of a larger tensor-parallel size holds fewer KV heads per layer
than a prefill rank; it needs only its heads' rows of each block. Through the
content map every (layer, block, state, head) row of C bytes has a known
address on both sides, whatever the layouts and kernel splits; rows adjacent
on both sides merge (a head's states are one run under LBHNC / LHBNC).
"""

from __future__ import annotations

import torch

from kvcore.transfer.descriptor import KVCacheDescriptor, LayerDescriptor
from kvcore.transfer.pairs import PairedRuns, merge_pairs

_SAME = ("kind", "content_bytes", "head_size", "head_size_v", "tokens_per_state", "k_bytes", "v_bytes")


def head_slice_mismatch(
    local: KVCacheDescriptor, remote: KVCacheDescriptor, group_id: int, head_start: int | None
) -> str | None:
    """Why the local heads cannot be read from remote heads ``head_start...``, or None.

    ``head_start=None`` checks only that the rows agree (head counts may differ).
    """
    a, b = local.group(group_id), remote.group(group_id)
    if a.block_size != b.block_size:
        return f"group {group_id} block size: {a.block_size} here, {b.block_size} on the peer"
    if len(a.layers) != len(b.layers) or not a.layers:
        return f"group {group_id} has {len(a.layers)} layers with cache pages here, {len(b.layers)} on the peer"
    for la, lb in zip(a.layers, b.layers):
        ca, cb = la.content, lb.content
        if ca.kind != "attention" or la.dtype != lb.dtype or any(getattr(ca, f) != getattr(cb, f) for f in _SAME):
            return f"layer {la.name!r} stores other rows than the peer's {lb.name!r} (dtype, head size or content)"
        if head_start is not None and (head_start < 0 or head_start + ca.num_kv_heads > cb.num_kv_heads):
            return (
                f"heads {head_start}..{head_start + ca.num_kv_heads - 1} do not exist on the peer, "
                f"which has {cb.num_kv_heads} KV heads in layer {lb.name!r}"
            )
    return None


def head_rows(layer: LayerDescriptor, ids: torch.Tensor, head0: int, num_heads: int) -> torch.Tensor:
    """Start byte of every (block, state, head) row, block-major, for heads ``head0...``."""
    s = layer.byte_strides
    states = layer.shape[2]
    t = torch.arange(layer.rows_per_block * states)
    within = (t // states) * s[0] + (t % states) * s[2]
    heads = (head0 + torch.arange(num_heads)) * s[1]
    starts = layer.offset + ids[:, None, None] * layer.manager_block_stride + within[None, :, None] + heads[None, None, :]
    return starts.reshape(-1)


def pair_head_rows(
    src: KVCacheDescriptor, src_ids: torch.Tensor, src_head0: int,
    dst: KVCacheDescriptor, dst_ids: torch.Tensor, dst_head0: int,
    *, group_id: int, num_heads: int,
) -> list[PairedRuns]:
    """Copies moving heads ``src_head0...`` of ``src`` blocks onto heads ``dst_head0...`` of ``dst`` blocks."""
    parts = []
    for ls, ld in zip(src.group(group_id).layers, dst.group(group_id).layers):
        s = head_rows(ls, src_ids, src_head0, num_heads)
        d = head_rows(ld, dst_ids, dst_head0, num_heads)
        parts.append((ls.allocation, ld.allocation, s, d, torch.full_like(s, ls.content.content_bytes)))
    out = []
    for sa, da in sorted({(p[0], p[1]) for p in parts}):
        chosen = [p for p in parts if (p[0], p[1]) == (sa, da)]
        merged = merge_pairs(*(torch.cat([p[i] for p in chosen]) for i in (2, 3, 4)))
        out.append(PairedRuns(sa, da, *merged))
    return out
