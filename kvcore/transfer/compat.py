"""Whether a peer's KV cache can exchange blocks (or some KV heads of them) with this one."""

from __future__ import annotations

from kvcore.transfer.descriptor import GroupDescriptor, KVCacheDescriptor
from kvcore.transfer.pairs import structure_mismatch
from kvcore.transfer.regions import block_patterns

# Content fields two caches must share for their (state, head) rows to be interchangeable.
_SAME_ROWS = ("kind", "content_bytes", "head_size", "head_size_v", "tokens_per_state", "k_bytes",
              "v_bytes")


def _layer_counts(g: int, a: GroupDescriptor, b: GroupDescriptor) -> str:
    counts = f"{len(a.layers)} layers with cache pages here, {len(b.layers)} on the peer"
    return f"group {g} has {counts}"


def _group_reason(g: int, a: GroupDescriptor, b: GroupDescriptor) -> str | None:
    for field in ("spec_type", "block_size", "kernel_block_size"):
        here, there = getattr(a, field), getattr(b, field)
        if here != there:
            return f"group {g} {field}: {here!r} here, {there!r} on the peer"
    if len(a.layers) != len(b.layers):
        return _layer_counts(g, a, b)
    for la, lb in zip(a.layers, b.layers):
        ca, cb = la.content, lb.content
        if la.dtype != lb.dtype:
            return f"layer {la.name!r} dtype: {la.dtype} here, {lb.dtype} on the peer ({lb.name!r})"
        if ca != cb:
            return (
                f"layer {la.name!r} content differs: {ca.num_kv_heads} KV heads of size "
                f"{ca.head_size}/{ca.head_size_v} ({ca.content_bytes} bytes per row) here, "
                f"{cb.num_kv_heads} of size {cb.head_size}/{cb.head_size_v} "
                f"({cb.content_bytes} bytes) on the peer"
            )
        if la.shape[1:] != lb.shape[1:] or la.rows_per_block != lb.rows_per_block:
            return (
                f"layer {la.name!r} view per block: {la.rows_per_block} x {list(la.shape[1:])} "
                f"here, {lb.rows_per_block} x {list(lb.shape[1:])} on the peer"
            )
    return None


def incompatibility(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> str | None:
    """Why whole blocks cannot move between ``local`` and ``remote`` unchanged, or None.

    Block counts and addresses may differ; layout, groups, block sizes, dtypes, heads
    and the runs of a block must not.
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
            reason = structure_mismatch(
                block_patterns(local, (g,), None), block_patterns(remote, (g,), None)
            )
            reason = None if reason is None else f"group {g}: {reason}"
        if reason is not None:
            return reason
    return None


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
        return _layer_counts(group_id, a, b)
    for la, lb in zip(a.layers, b.layers):
        ca, cb = la.content, lb.content
        if ca.kind != "attention" or la.dtype != lb.dtype or any(
            getattr(ca, f) != getattr(cb, f) for f in _SAME_ROWS
        ):
            return (
                f"layer {la.name!r} stores other rows than the peer's {lb.name!r} "
                "(dtype, head size or content)"
            )
        if head_start is not None and not 0 <= head_start <= cb.num_kv_heads - ca.num_kv_heads:
            return (
                f"heads {head_start}..{head_start + ca.num_kv_heads - 1} do not exist on the peer, "
                f"which has {cb.num_kv_heads} KV heads in layer {lb.name!r}"
            )
    return None
