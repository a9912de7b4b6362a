"""NixlAgent: move KV cache blocks between processes through NIXL.

The agent registers the KV cache's one allocation with NIXL once. Peers
exchange :meth:`NixlAgent.metadata` (NIXL's agent metadata plus the kvcore
descriptor) by any local channel; :meth:`connect` refuses a peer whose cache
is laid out differently. Transfers are planned with the paired plans of
:mod:`kvcore.transfer.pairs`, so only the listed blocks' bytes move.
NIXL is optional: ``pip install kvcore[nixl]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any

import torch

from kvcore.errors import KVCoreError
from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer.compat import incompatibility
from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.describe import describe
from kvcore.transfer.heads import head_slice_mismatch, pair_head_rows
from kvcore.transfer.host_pool import group_selection, raw_allocation, whole_block_patterns
from kvcore.transfer.ids import paired_ids
from kvcore.transfer.nixl_api import (
    PreparedRuns,
    TransferError,
    TransferHandle,
    contiguous_runs,
    descriptor_rows,
    mem_type,
    nixl_api,
    xfer_array,
)
from kvcore.transfer.pairs import PairedRuns, pair_runs, structure_mismatch
from kvcore.transfer.transport import Transport, process_info, transport_between

_MAGIC = b"kvcore-nixl/2\n"
_LOCAL = "NIXL_INIT_AGENT"  # NOTE: NIXL's name for the initiator's own side of a prepared list


class IncompatiblePeerError(KVCoreError):
    """A peer's KV cache cannot exchange blocks with this one; the message says why."""


def _pack(name: str, descriptor: KVCacheDescriptor, agent_metadata: bytes) -> bytes:
    parts = [name.encode(), descriptor.to_json().encode(), json.dumps(process_info()).encode()]
    return _MAGIC + struct.pack(">QQQ", *map(len, parts)) + b"".join(parts) + agent_metadata


def _unpack(data: bytes) -> tuple[str, KVCacheDescriptor, dict, bytes]:
    if not isinstance(data, (bytes, bytearray)) or not data.startswith(_MAGIC):
        raise ValueError(
            "peer metadata is not from this kvcore version's NixlAgent.metadata(); pass those bytes "
            "unchanged, from a peer running the same kvcore"
        )
    head = len(_MAGIC) + 24
    try:
        sizes = struct.unpack(">QQQ", data[len(_MAGIC) : head])
        if head + sum(sizes) > len(data):
            raise ValueError("truncated")
        ends = [head + sum(sizes[: i + 1]) for i in range(3)]
        name = bytes(data[head : ends[0]]).decode()
        desc_text, info = bytes(data[ends[0] : ends[1]]), json.loads(data[ends[1] : ends[2]])
    except (struct.error, ValueError) as exc:
        raise ValueError(f"peer metadata is damaged ({exc}); pass the bytes of metadata() unchanged") from None
    try:
        desc = KVCacheDescriptor.from_json(desc_text)
    except (TypeError, ValueError) as exc:
        raise IncompatiblePeerError(
            f"peer {name!r} sent a KV cache descriptor kvcore refuses, so no block moves to or from it: {exc}"
        ) from None
    return name, desc, info if isinstance(info, dict) else {}, bytes(data[ends[2] :])


def _backend_of(agent: Any, handle: TransferHandle) -> str | None:
    """The NIXL backend that carries a posted transfer (``"UCX"``), None where NIXL cannot say."""
    try:
        return agent.query_xfer_backend(handle._handle)
    except Exception:  # NOTE: older NIXL builds lack the query; the report then says None
        return None


class NixlAgent:
    """A NIXL agent named ``name`` serving ``kv_cache``'s blocks (UCX by default).

    ``progress_thread=False`` makes NIXL progress transfers only when a handle
    is polled (``wait()``/``done()``), in the caller's thread, which holds the
    cache's CUDA context; by default NIXL's own progress thread does it.
    """

    def __init__(self, name: str, kv_cache: KVCache, *, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = True) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"agent name must be a non-empty str, got {name!r}")
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"NixlAgent needs a kvcore.KVCache, got {type(kv_cache).__name__}")
        agent_cls, config_cls = nixl_api()
        self.name, self.kv_cache = name, kv_cache
        self.descriptor = describe(kv_cache)
        self._raw = raw_allocation(kv_cache)
        self._registered = None
        device = self._raw.device
        # UCX's CUDA transports read the calling thread's CUDA context when the agent starts: make
        # the cache's device (whose primary context exists: the cache is allocated) current meanwhile.
        current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        if device.type == "cuda":
            # NOTE: without NVLink UCX turns cuda_ipc's get (READ) path off and reads crawl over a
            # staged fallback: 0.4 GB/s against 48 GB/s with it on (H200, two processes, BENCHMARKS.md).
            # UCX reads this when the agent's context starts; a value the user set is kept.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        try:
            with current:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                config = config_cls(backends=list(backends), enable_prog_thread=bool(progress_thread))
                self._agent = agent_cls(name, config)
                self._registered = self._agent.register_memory([self._raw])
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions (nixlBackendError, ...)
            raise TransferError(
                f"NIXL could not start agent {name!r} with backends {list(backends)} on {device}: "
                f"{exc!r}; check that NIXL's UCX plugin loads (UCX_LOG_LEVEL=info shows why it does not)"
            ) from exc
        self._peers: dict[str, KVCacheDescriptor] = {}
        self._block_reasons: dict[str, str | None] = {}
        self._transports: dict[str, Transport] = {}
        #: (peer, or _LOCAL for this side; group ids) -> that side's runs, prepared with NIXL once
        self._prepared: dict[tuple[str, tuple[int, ...]], PreparedRuns] = {}

    def metadata(self) -> bytes:
        """What a peer passes to :meth:`connect`: NIXL's agent metadata and this cache's descriptor."""
        return _pack(self.name, self.descriptor, self._agent.get_agent_metadata())

    def connect(self, peer_metadata: bytes, *, heads_may_differ: bool = False) -> str:
        """Add a peer from its :meth:`metadata`; returns its name.

        Raises :class:`IncompatiblePeerError` (a ``ValueError``) saying why when
        the peer's cache differs in layout, block size, dtype, heads or block
        runs. With ``heads_may_differ`` a peer of another tensor-parallel size
        (other head counts, any layout) is accepted for :meth:`read_head_slice`;
        whole-block transfers to it are then refused.
        """
        name, desc, info, agent_md = _unpack(peer_metadata)
        if name == self.name:
            raise ValueError(f"peer metadata names this agent itself ({name!r}); pass the other process's")
        reason = incompatibility(self.descriptor, desc)
        if reason is not None and heads_may_differ:
            rows = [head_slice_mismatch(self.descriptor, desc, g.group_id, None)
                    for g in self.descriptor.groups if g.layers]
            if len(desc.groups) != len(self.descriptor.groups) or any(rows):
                raise IncompatiblePeerError(
                    f"cannot exchange KV heads with peer {name!r}: "
                    + next((r for r in rows if r), "the KV cache groups differ")
                )
        elif reason is not None:
            raise IncompatiblePeerError(f"cannot exchange KV blocks with peer {name!r}: {reason}")
        try:
            added = self._agent.add_remote_agent(agent_md)
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions (nixlBackendError, ...)
            raise TransferError(
                f"NIXL could not connect to peer {name!r} ({exc!r}); the peer process may have exited "
                "or its metadata is stale: restart the peer and pass its fresh metadata()"
            ) from exc
        added = added.decode() if isinstance(added, bytes) else str(added)
        for key in [k for k in self._prepared if k[0] == added]:  # NOTE: a reconnected peer's old lists
            with contextlib.suppress(Exception):
                self._prepared.pop(key).release()
        self._peers[added] = desc
        self._block_reasons[added] = reason
        self._transports[added] = transport_between(self.descriptor, desc, info)
        return added

    def transport(self, peer: str) -> Transport:
        """How UCX moves bytes to and from ``peer`` (see :mod:`kvcore.transfer.transport`)."""
        self._peer(peer)
        return self._transports[peer]

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def write_blocks(self, peer: str, local_ids: Any, remote_ids: Any, *, group_id: int | None = None) -> TransferHandle:
        """Write local blocks ``local_ids`` into the peer's blocks ``remote_ids`` (pairwise)."""
        return self._transfer("WRITE", peer, local_ids, remote_ids, group_id, local_is_dst=False)

    def read_blocks(self, peer: str, remote_ids: Any, local_ids: Any, *, group_id: int | None = None) -> TransferHandle:
        """Read the peer's blocks ``remote_ids`` into local blocks ``local_ids`` (pairwise)."""
        return self._transfer("READ", peer, remote_ids, local_ids, group_id, local_is_dst=True)

    def plan(self, peer: str, local_ids: Any, remote_ids: Any, *, group_id: int | None = None,
             local_is_dst: bool = False) -> list[PairedRuns]:
        """Validated copies between local blocks (``src`` side) and the peer's."""
        loc, rem = self._paired(peer, local_ids, remote_ids, local_is_dst)
        groups = group_selection(self.kv_cache, self.descriptor, group_id)
        return pair_runs(whole_block_patterns(self.descriptor, groups), loc,
                         whole_block_patterns(self._peers[peer], groups), rem)

    def _paired(self, peer: str, local_ids: Any, remote_ids: Any, local_is_dst: bool):
        """Checked ``(local, remote)`` id tensors of a whole-block transfer with ``peer``."""
        remote = self._peer(peer)
        if self._block_reasons[peer] is not None:
            raise IncompatiblePeerError(
                f"peer {peer!r} was connected for head slices only; whole blocks cannot move: "
                f"{self._block_reasons[peer]}"
            )
        local_n, remote_n = self.descriptor.num_blocks, remote.num_blocks
        if local_is_dst:
            rem, loc = paired_ids(remote_ids, remote_n, local_ids, local_n,
                                  src_what=f"block id of peer {peer!r}", dst_what="local block id")
        else:
            loc, rem = paired_ids(local_ids, local_n, remote_ids, remote_n,
                                  src_what="local block id", dst_what=f"block id of peer {peer!r}")
        return loc, rem

    def _peer(self, peer: str) -> KVCacheDescriptor:
        if peer not in self._peers:
            raise ValueError(f"peer {peer!r} is not connected; connected peers: {self.peers}. Call connect() first")
        return self._peers[peer]

    def read_head_slice(self, peer: str, remote_ids: Any, local_ids: Any, *, head_start: int,
                        group_id: int = 0) -> TransferHandle:
        """Read KV heads ``head_start ...`` of the peer's blocks into all heads of local blocks.

        For a decode rank whose tensor-parallel shard holds fewer KV heads than
        the prefill rank's: only those heads' (state, head) rows move, found
        through both descriptors' content maps (layouts may differ).
        """
        remote = self._peer(peer)
        if type(head_start) is not int:
            raise TypeError(f"head_start must be an int, got {head_start!r}")
        reason = head_slice_mismatch(self.descriptor, remote, group_id, head_start)
        if reason is not None:
            raise IncompatiblePeerError(f"cannot read heads from peer {peer!r}: {reason}")
        rem, loc = paired_ids(remote_ids, remote.num_blocks, local_ids, self.descriptor.num_blocks,
                              src_what=f"block id of peer {peer!r}", dst_what="local block id")
        heads = self.descriptor.group(group_id).layers[0].content.num_kv_heads
        plan = pair_head_rows(remote, rem, head_start, self.descriptor, loc, 0, group_id=group_id, num_heads=heads)
        return self._post("READ", peer, plan, local_is_src=False)

    def _transfer(self, op: str, peer: str, src_ids: Any, dst_ids: Any, group_id: int | None,
                  *, local_is_dst: bool) -> TransferHandle:
        """Whole blocks through both sides' prepared lists: one ``make_prepped_xfer`` by index."""
        local_ids, remote_ids = (dst_ids, src_ids) if local_is_dst else (src_ids, dst_ids)
        loc, rem = self._paired(peer, local_ids, remote_ids, local_is_dst)
        groups = group_selection(self.kv_cache, self.descriptor, group_id)
        local, far = self._prepare(_LOCAL, self.descriptor, groups), self._prepare(peer, self._peers[peer], groups)
        transport = self._transports[peer]
        if not loc.numel():
            return TransferHandle(self._agent, None, 0, 0, transport)
        order = torch.argsort(loc)  # NOTE: blocks adjacent on both sides become one copy in NIXL
        local_index, local_addresses = local.indices(loc[order].numpy())
        remote_index, remote_addresses = far.indices(rem[order].numpy())
        lengths = local.lengths.repeat(loc.numel())
        runs = contiguous_runs(local_addresses, remote_addresses, lengths)
        try:
            handle = self._agent.make_prepped_xfer(op, local.handle, local_index, far.handle, remote_index)
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions
            raise TransferError(f"NIXL could not prepare the {op} with peer {peer!r} ({exc!r})") from exc
        return self._start(op, peer, handle, runs, int(lengths.sum()))

    def _prepare(self, owner: str, descriptor: KVCacheDescriptor, groups: tuple[int, ...]) -> PreparedRuns:
        """``owner``'s runs of ``groups`` as a NIXL prepared list (made on first use, then kept)."""
        key = (owner, groups)
        if key not in self._prepared:
            local = whole_block_patterns(self.descriptor, groups)
            patterns = local if owner == _LOCAL else whole_block_patterns(descriptor, groups)
            reason = structure_mismatch(local, patterns)
            if reason is not None:
                raise IncompatiblePeerError(f"cannot exchange KV blocks with peer {owner!r}: {reason}")
            try:
                self._prepared[key] = PreparedRuns(self._agent, owner, descriptor, patterns)
            except Exception as exc:  # NOTE: NIXL raises its own binding exceptions
                raise TransferError(
                    f"NIXL could not prepare the descriptor list of {owner!r} ({exc!r}); if the peer "
                    "process exited, reconnect to a live one (connect() with its fresh metadata())"
                ) from exc
        return self._prepared[key]

    def _post(self, op: str, peer: str, plan: list[PairedRuns], *, local_is_src: bool) -> TransferHandle:
        """Start one NIXL transfer of ``plan`` (whose ``src`` side is local when ``local_is_src``)."""
        remote = self._peers[peer]
        runs = sum(p.num_runs for p in plan)
        transport = self._transports[peer]
        if not runs:
            return TransferHandle(self._agent, None, 0, 0, transport)
        local_rows, remote_rows = [], []
        for part in plan:
            l_alloc, l_off, r_alloc, r_off = (
                (part.src_allocation, part.src_offsets, part.dst_allocation, part.dst_offsets) if local_is_src
                else (part.dst_allocation, part.dst_offsets, part.src_allocation, part.src_offsets)
            )
            la, ra = self.descriptor.allocations[l_alloc], remote.allocations[r_alloc]
            local_rows.append(descriptor_rows(la.base_ptr, l_off, part.lengths, mem_type(la.device)[1]))
            remote_rows.append(descriptor_rows(ra.base_ptr, r_off, part.lengths, mem_type(ra.device)[1]))
        local_type = mem_type(self.descriptor.allocations[0].device)[0]
        remote_type = mem_type(remote.allocations[0].device)[0]
        try:
            local = self._agent.get_xfer_descs(xfer_array(local_rows), local_type)
            far = self._agent.get_xfer_descs(xfer_array(remote_rows), remote_type)
            handle = self._agent.initialize_xfer(op, local, far, peer)
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions
            raise TransferError(f"NIXL could not prepare the {op} with peer {peer!r} ({exc!r})") from exc
        return self._start(op, peer, handle, runs, sum(p.nbytes for p in plan))

    def _start(self, op: str, peer: str, handle: Any, runs: int, nbytes: int) -> TransferHandle:
        """Post a NIXL transfer handle; a refusal releases it and raises :class:`TransferError`."""
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions
            state = repr(exc)
        if state not in ("DONE", "PROC"):
            self._agent.release_xfer_handle(handle)
            raise TransferError(
                f"NIXL could not start the {op} with peer {peer!r} ({state}); if the peer process "
                "exited, reconnect to a live one (connect() with its fresh metadata())"
            )
        started = TransferHandle(self._agent, handle, runs, nbytes, self._transports[peer])
        started.backend = _backend_of(self._agent, started)
        return started

    def close(self) -> None:
        """Forget the peers and deregister the allocation (errors of a dead peer are ignored)."""
        for prepared in self._prepared.values():
            with contextlib.suppress(Exception):  # NOTE: a dead peer's list may be gone already
                prepared.release()
        for peer in list(self._peers):
            with contextlib.suppress(Exception):  # NOTE: a peer that died cannot be told; forgetting it is enough
                self._agent.remove_remote_agent(peer)
        self._prepared.clear()
        self._peers.clear()
        self._block_reasons.clear()
        self._transports.clear()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
