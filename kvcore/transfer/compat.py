"""Whether blocks of one KV cache can be copied byte for byte onto another's."""

from __future__ import annotations

from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.pairs import structure_mismatch
from kvcore.transfer.plan import block_patterns


def _group_reason(g: int, a, b) -> str | None:
    for field in ("spec_type", "block_size", "kernel_block_size"):
        if getattr(a, field) != getattr(b, field):
            return f"group {g} {field}: {getattr(a, field)!r} here, {getattr(b, field)!r} on the peer"
    if len(a.layers) != len(b.layers):
        return f"group {g} has {len(a.layers)} layers with cache pages here, {len(b.layers)} on the peer"
    for la, lb in zip(a.layers, b.layers):
        if la.dtype != lb.dtype:
            return f"layer {la.name!r} dtype: {la.dtype} here, {lb.dtype} on the peer ({lb.name!r})"
        if la.content != lb.content:
            ca, cb = la.content, lb.content
            return (
                f"layer {la.name!r} content differs: {ca.num_kv_heads} KV heads of size "
                f"{ca.head_size}/{ca.head_size_v} ({ca.content_bytes} bytes per row) here, "
                f"{cb.num_kv_heads} of size {cb.head_size}/{cb.head_size_v} "
                f"({cb.content_bytes} bytes) on the peer"
            )
        if la.shape[1:] != lb.shape[1:] or la.rows_per_block != lb.rows_per_block:
            return (
                f"layer {la.name!r} view per block: {la.rows_per_block} x {list(la.shape[1:])} here, "
                f"{lb.rows_per_block} x {list(lb.shape[1:])} on the peer"
            )
    return None


def incompatibility(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> str | None:
    """Why blocks cannot move between ``local`` and ``remote`` unchanged, or None when they can.

    Block counts and addresses may differ; layout, groups, block sizes, dtypes,
    heads and the runs of a block must not.
    """
    if local.version != remote.version:
        return f"descriptor version {local.version} here, {remote.version} on the peer"
    if local.layout != remote.layout:
        return f"layout {local.layout} here, {remote.layout} on the peer; plan both with one layout"
    if len(local.groups) != len(remote.groups):
        return f"{len(local.groups)} KV cache groups here, {len(remote.groups)} on the peer"
    for g, (a, b) in enumerate(zip(local.groups, remote.groups)):
        reason = _group_reason(g, a, b)
        if reason is None and a.layers:
            reason = structure_mismatch(block_patterns(local, (g,), None), block_patterns(remote, (g,), None))
            reason = None if reason is None else f"group {g}: {reason}"
        if reason is not None:
            return reason
    return None
