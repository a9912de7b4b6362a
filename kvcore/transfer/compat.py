"""What a NIXL peer sends (:func:`pack`), and whether its KV cache can exchange blocks (or
some KV heads of them) with this one (:func:`check_peer`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import attrs

from kvcore.errors import KVCoreError
from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.pairs import structure_mismatch
from kvcore.transfer.regions import block_patterns
from kvcore.transfer.transport import process_info

_MAGIC = b"kvcore-nixl/3\n"


class IncompatiblePeerError(KVCoreError):
    """A peer's KV cache cannot exchange blocks with this one; the message says why."""


def pack(name: str, descriptor: KVCacheDescriptor, agent_metadata: bytes) -> bytes:
    """An agent's metadata for its peers: name, descriptor, process, NIXL's own metadata."""
    header = {"name": name, "descriptor": descriptor.to_json(), "process": process_info()}
    return _MAGIC + json.dumps(header).encode() + b"\n" + agent_metadata


def unpack(data: bytes) -> tuple[str, KVCacheDescriptor, dict, bytes]:
    """``(name, descriptor, process, NIXL metadata)`` of :func:`pack` bytes, checked."""
    if not isinstance(data, (bytes, bytearray)) or not data.startswith(_MAGIC):
        raise ValueError("peer metadata is not from this kvcore version's NixlAgent.metadata(); "
                         "pass those bytes unchanged, from a peer running the same kvcore")
    header, _, agent_metadata = bytes(data[len(_MAGIC) :]).partition(b"\n")
    try:
        fields = json.loads(header)
        name, desc_text, info = fields["name"], fields["descriptor"], fields["process"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"peer metadata is damaged ({exc}); pass the bytes of metadata() unchanged") from None
    if not isinstance(name, str) or not name:
        raise ValueError(f"peer metadata names its agent {name!r}, not a non-empty str; pass the "
                         "bytes of metadata() unchanged")
    try:
        desc = KVCacheDescriptor.from_json(desc_text)
    except (TypeError, ValueError) as exc:
        raise IncompatiblePeerError(f"peer {name!r} sent a KV cache descriptor kvcore refuses, "
                                    f"so no block moves to or from it: {exc}") from None
    return name, desc, info if isinstance(info, dict) else {}, agent_metadata


def _facts(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> Iterator[tuple]:
    """``(what, here, there)`` of every fact that must agree for whole blocks, outermost first."""
    yield "descriptor version", local.version, remote.version
    yield "KV cache dtype", local.kv_cache_dtype, remote.kv_cache_dtype
    yield "layout", local.layout, remote.layout
    yield "number of KV cache groups", len(local.groups), len(remote.groups)
    for g, (a, b) in enumerate(zip(local.groups, remote.groups)):
        for field in ("spec_type", "block_size", "kernel_block_size"):
            yield f"group {g} {field}", getattr(a, field), getattr(b, field)
        yield f"group {g} layers with cache pages", len(a.layers), len(b.layers)
        for la, lb in zip(a.layers, b.layers):
            yield f"layer {la.name!r} dtype", la.dtype, lb.dtype
            yield f"layer {la.name!r} content (KV heads, sizes)", la.content, lb.content
            yield (f"layer {la.name!r} rows per block x view per row",
                   (la.rows_per_block, la.shape[1:]), (lb.rows_per_block, lb.shape[1:]))


def incompatibility(local: KVCacheDescriptor, remote: KVCacheDescriptor) -> str | None:
    """Why whole blocks cannot move between ``local`` and ``remote`` unchanged, or None (block
    counts and addresses may differ; layout, groups, sizes, dtypes, heads and runs may not)."""
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
    """Why the local heads cannot be read from remote heads ``head_start...``, or None;
    ``head_start=None`` checks only that the rows agree (head counts may differ)."""
    a, b = local.group(group_id), remote.group(group_id)
    if a.block_size != b.block_size:
        return f"group {group_id} block size: {a.block_size} here, {b.block_size} on the peer"
    if len(a.layers) != len(b.layers) or not a.layers:
        return (f"group {group_id} has {len(a.layers)} layers with cache pages here, {len(b.layers)} on the peer")
    if local.kv_cache_dtype != remote.kv_cache_dtype:
        return f"KV cache dtype: {local.kv_cache_dtype} here, {remote.kv_cache_dtype} on the peer"
    for la, lb in zip(a.layers, b.layers):
        ca, cb = la.content, lb.content
        if la.scales is not None:
            return f"layer {la.name!r} keeps per-token-head scales, which move with whole blocks only"
        rows = [attrs.evolve(c, num_kv_heads=0, num_head_slots=0) for c in (ca, cb)]
        if ca.kind != "attention" or la.dtype != lb.dtype or rows[0] != rows[1]:
            return (f"layer {la.name!r} stores other rows than the peer's {lb.name!r} (dtype, head size or content)")
        if head_start is not None and not 0 <= head_start <= cb.num_kv_heads - ca.num_kv_heads:
            return (f"heads {head_start}..{head_start + ca.num_kv_heads - 1} do not exist on the "
                    f"peer, which has {cb.num_kv_heads} KV heads in layer {lb.name!r}")
    return None


def check_peer(name: str, local: KVCacheDescriptor, remote: KVCacheDescriptor, heads_may_differ: bool) -> str | None:
    """Refuse peer ``name`` unless whole blocks (or, ``heads_may_differ``, head slices) can
    move; returns why whole blocks cannot (a peer for head slices only), or None."""
    reason = incompatibility(local, remote)
    if reason is None:
        return None
    if not heads_may_differ:
        raise IncompatiblePeerError(f"cannot exchange KV blocks with peer {name!r}: {reason}")
    why = "the KV cache groups differ" if len(remote.groups) != len(local.groups) else None
    for group in local.groups:
        if why is None and group.layers:
            why = head_slice_mismatch(local, remote, group.group_id, None)
    if why is not None:
        raise IncompatiblePeerError(f"cannot exchange KV heads with peer {name!r}: {why}")
    return reason
