"""Whether a peer's KV cache can exchange blocks (or some KV heads of them) with this one."""

from __future__ import annotations

from collections.abc import Iterator

from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.pairs import structure_mismatch
from kvcore.transfer.regions import block_patterns

# Content fields two caches must share for their (state, head) rows to be interchangeable.
_SAME_ROWS = ("kind", "content_bytes", "head_size", "head_size_v", "tokens_per_state", "k_bytes",
              "v_bytes")


def _facts(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> Iterator[tuple]:
    """``(what, here, there)`` of every fact that must agree for whole blocks, outermost first."""
    yield "descriptor version", local.version, remote.version
    yield "layout", local.layout, remote.layout
    yield "number of KV cache groups", len(local.groups), len(remote.groups)
    for g, (a, b) in enumerate(zip(local.groups, remote.groups)):
        for field in ("spec_type", "block_size", "kernel_block_size"):
            yield f"group {g} {field}", getattr(a, field), getattr(b, field)
        yield f"group {g} layers with cache pages", len(a.layers), len(b.layers)
        for la, lb in zip(a.layers, b.layers):
            ca, cb = la.content, lb.content
            yield f"layer {la.name!r} dtype", la.dtype, lb.dtype
            yield f"layer {la.name!r} KV heads", ca.num_kv_heads, cb.num_kv_heads
            sizes = ("head_size", "head_size_v", "content_bytes")
            yield (f"layer {la.name!r} {'/'.join(sizes)}", [getattr(ca, f) for f in sizes],
                   [getattr(cb, f) for f in sizes])
            yield f"layer {la.name!r} content", ca, cb
            yield (f"layer {la.name!r} rows per block x view per row",
                   (la.rows_per_block, la.shape[1:]), (lb.rows_per_block, lb.shape[1:]))


def incompatibility(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> str | None:
    """Why whole blocks cannot move between ``local`` and ``remote`` unchanged, or None.

    Block counts and addresses may differ; layout, groups, block sizes, dtypes, heads
    and the runs of a block must not.
    """
    for what, here, there in _facts(local, remote):
        if here != there:
            return f"{what}: {here} here, {there} on the peer"
    for g, group in enumerate(local.groups):
        if group.layers:
            patterns = (block_patterns(d, (g,), None) for d in (local, remote))
            reason = structure_mismatch(*patterns)
            if reason is not None:
                return f"group {g}: {reason}"
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
        return (f"group {group_id} has {len(a.layers)} layers with cache pages here, "
                f"{len(b.layers)} on the peer")
    for la, lb in zip(a.layers, b.layers):
        ca, cb = la.content, lb.content
        if ca.kind != "attention" or la.dtype != lb.dtype or any(
            getattr(ca, f) != getattr(cb, f) for f in _SAME_ROWS
        ):
            return (f"layer {la.name!r} stores other rows than the peer's {lb.name!r} "
                    "(dtype, head size or content)")
        if head_start is not None and not 0 <= head_start <= cb.num_kv_heads - ca.num_kv_heads:
            return (f"heads {head_start}..{head_start + ca.num_kv_heads - 1} do not exist on the "
                    f"peer, which has {cb.num_kv_heads} KV heads in layer {lb.name!r}")
    return None
