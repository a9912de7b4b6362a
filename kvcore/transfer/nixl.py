"""NixlAgent: move KV cache blocks between processes through NIXL (``pip install kvcore[nixl]``);
whole blocks by index into lists prepared once per side, head slices by the runs of each call."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer.compat import IncompatiblePeerError, check_peer, head_slice_mismatch, pack, unpack
from kvcore.transfer.descriptor import KVCacheDescriptor, describe, raw_allocation
from kvcore.transfer.nixl_api import (
    PreparedRuns,
    TransferError,
    TransferHandle,
    mem_type,
    nixl_api,
    paired_indices,
    xfer_arrays,
)
from kvcore.transfer.pairs import head_patterns, pair_runs, structure_mismatch
from kvcore.transfer.regions import group_selection, paired_ids, whole_block_patterns
from kvcore.transfer.transport import Transport, transport_between

_LOCAL = "NIXL_INIT_AGENT"  # NOTE: NIXL's name for the initiator's side of a prepared list
_RECONNECT = "if the peer process exited or resized its KV cache, connect() again with its fresh metadata()"


@contextlib.contextmanager
def _nixl(doing: str, remedy: str = _RECONNECT) -> Iterator[None]:
    """Turn NIXL's own binding exceptions (``nixlBackendError``...) into :class:`TransferError`."""
    try:
        yield
    except Exception as exc:
        raise TransferError(f"NIXL could not {doing} ({exc!r}); {remedy}") from exc


@attrs.frozen
class _Peer:
    descriptor: KVCacheDescriptor
    transport: Transport
    #: Why whole blocks cannot move (a peer connected for head slices only), or None.
    heads_only: str | None


class NixlAgent:
    """A NIXL agent named ``name`` serving ``kv_cache``'s blocks (UCX by default); with
    ``progress_thread=False`` NIXL progresses transfers only while a handle is polled."""

    def __init__(self, name: str, kv_cache: KVCache, *, backends: tuple[str, ...] = ("UCX",),
                 progress_thread: bool = True) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"agent name must be a non-empty str, got {name!r}")
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"NixlAgent needs a kvcore.KVCache, got {type(kv_cache).__name__}")
        agent_cls, config_cls = nixl_api()
        self.name, self.kv_cache, self.descriptor = name, kv_cache, describe(kv_cache)
        self._raw, self._registered, self._peers = raw_allocation(kv_cache), None, {}
        #: (peer, or _LOCAL for this side; group ids) -> that side's runs, prepared once
        self._prepared: dict[tuple[str, tuple[int, ...]], PreparedRuns] = {}
        device = self._raw.device
        cuda = device.type == "cuda"
        on_device = torch.cuda.device(device) if cuda else contextlib.nullcontext()
        if cuda:
            # NOTE: without NVLink UCX turns cuda_ipc's get (READ) path off and reads crawl over
            # a staged fallback: 0.4 GB/s against 48 GB/s with it on (H200, two processes).
            # UCX reads this when the agent's context starts; a value the user set is kept.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        doing = f"start agent {name!r} with backends {list(backends)} on {device}"
        remedy = "check that NIXL's UCX plugin loads (UCX_LOG_LEVEL=info shows why not)"
        # NOTE: UCX's CUDA transports read the thread's CUDA context when the agent starts:
        # the cache's device (whose primary context exists: the cache is allocated) is current.
        with _nixl(doing, remedy), on_device:
            if cuda:
                torch.cuda.synchronize(device)
            config = config_cls(backends=list(backends), enable_prog_thread=bool(progress_thread))
            self._agent = agent_cls(name, config)
            self._registered = self._agent.register_memory([self._raw])

    def metadata(self) -> bytes:
        """What a peer passes to :meth:`connect`: NIXL's agent metadata and this descriptor, of
        the cache's size now (a peer learns of a later resize only by connecting again)."""
        if self.descriptor.num_blocks != self.kv_cache.num_blocks:
            self.descriptor = describe(self.kv_cache)
        return pack(self.name, self.descriptor, self._agent.get_agent_metadata())

    def connect(self, peer_metadata: bytes, *, heads_may_differ: bool = False) -> str:
        """Add a peer from its :meth:`metadata`; returns its name.

        Raises :class:`IncompatiblePeerError` saying why when the peer's cache differs in
        layout, block size, dtype, heads or block runs. With ``heads_may_differ`` a peer of
        another tensor-parallel size (other head counts, any layout) is accepted for
        :meth:`read_head_slice` only.
        """
        name, desc, info, agent_md = unpack(peer_metadata)
        if name == self.name:
            raise ValueError(f"peer metadata names this agent itself ({name!r}); pass the other process's")
        reason = check_peer(name, self.descriptor, desc, heads_may_differ)
        remedy = ("the peer process may have exited or its metadata is stale: restart the peer "
                  "and pass its fresh metadata()")
        if name in self._peers:  # NOTE: NIXL keeps a peer it saw fail disconnected until removed
            self._forget(name)
        with _nixl(f"connect to peer {name!r}", remedy):
            added = self._agent.add_remote_agent(agent_md)
        added = added.decode() if isinstance(added, bytes) else str(added)
        for key in [k for k in self._prepared if k[0] == added]:  # NOTE: a reconnected peer's
            with contextlib.suppress(Exception):
                self._prepared.pop(key).release()
        self._peers[added] = _Peer(desc, transport_between(self.descriptor, desc, info), reason)
        return added

    def transport(self, peer: str) -> Transport:
        """How UCX moves bytes to and from ``peer`` (see :mod:`kvcore.transfer.transport`)."""
        return self._peer(peer).transport

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def _peer(self, peer: str) -> _Peer:
        if peer not in self._peers:
            raise ValueError(f"peer {peer!r} is not connected; connected peers: {self.peers}. Call connect() first")
        return self._peers[peer]

    def write_blocks(self, peer: str, local_ids: Any, remote_ids: Any, *,
                     group_id: int | None = None) -> TransferHandle:
        """Write local blocks ``local_ids`` into the peer's blocks ``remote_ids`` (pairwise)."""
        return self._blocks("WRITE", peer, local_ids, remote_ids, group_id)

    def read_blocks(self, peer: str, remote_ids: Any, local_ids: Any, *, group_id: int | None = None) -> TransferHandle:
        """Read the peer's blocks ``remote_ids`` into local blocks ``local_ids`` (pairwise)."""
        return self._blocks("READ", peer, local_ids, remote_ids, group_id)

    def _blocks(self, op: str, peer: str, local_ids: Any, remote_ids: Any, group_id: int | None) -> TransferHandle:
        remote = self._peer(peer)
        if remote.heads_only is not None:
            raise IncompatiblePeerError(f"peer {peer!r} was connected for head slices only; whole "
                                        f"blocks cannot move: {remote.heads_only}")
        loc, rem = self._ids(op, peer, local_ids, remote_ids)
        groups = group_selection(self.descriptor, group_id)
        if not loc.numel():
            return TransferHandle(self._agent, None, 0, 0, remote.transport)
        local = self._prepare(_LOCAL, self.descriptor, groups)
        far = self._prepare(peer, remote.descriptor, groups)
        local_index, remote_index, runs, nbytes = paired_indices(local, far, loc, rem)
        with _nixl(f"prepare the {op} with peer {peer!r}"):
            handle = self._agent.make_prepped_xfer(op, local.handle, local_index, far.handle, remote_index)
        return self._start(op, peer, handle, runs, nbytes)

    def _prepare(self, owner: str, descriptor: KVCacheDescriptor, groups: tuple[int, ...]) -> PreparedRuns:
        """``owner``'s runs of ``groups`` as a NIXL prepared list (made on first use, then kept
        while that side's size stays: this side's is made again after a resize)."""
        key = (owner, groups)
        size = self.kv_cache.num_blocks if owner == _LOCAL else descriptor.num_blocks
        if key in self._prepared and self._prepared[key].num_blocks != size:
            with contextlib.suppress(Exception):  # NOTE: NIXL may have dropped it already
                self._prepared.pop(key).release()
        if key not in self._prepared:
            patterns = whole_block_patterns(descriptor, groups)
            if owner != _LOCAL:  # NOTE: connect() checked whole blocks pair up; this is per group
                reason = structure_mismatch(whole_block_patterns(self.descriptor, groups), patterns)
                if reason is not None:
                    raise IncompatiblePeerError(f"cannot exchange KV blocks with peer {owner!r}: {reason}")
            with _nixl(f"prepare the descriptor list of {owner!r}"):
                prepared = PreparedRuns(descriptor, patterns, size)
                self._prepared[key] = prepared.prepare(self._agent, owner)
        return self._prepared[key]

    def read_head_slice(self, peer: str, remote_ids: Any, local_ids: Any, *, head_start: int,
                        group_id: int = 0) -> TransferHandle:
        """Read KV heads ``head_start ...`` of the peer's blocks into all heads of local blocks
        (a decode rank holding fewer KV heads than the prefill rank; layouts may differ)."""
        remote = self._peer(peer).descriptor
        if type(head_start) is not int:
            raise TypeError(f"head_start must be an int, got {head_start!r}")
        reason = head_slice_mismatch(self.descriptor, remote, group_id, head_start)
        if reason is not None:
            raise IncompatiblePeerError(f"cannot read heads from peer {peer!r}: {reason}")
        loc, rem = self._ids("READ", peer, local_ids, remote_ids)
        heads = self.descriptor.group(group_id).layers[0].content.num_kv_heads
        plan = pair_runs(head_patterns(remote.group(group_id).layers, head_start, heads), rem,
                         head_patterns(self.descriptor.group(group_id).layers, 0, heads), loc)
        runs = sum(p.num_runs for p in plan)
        if not runs:
            return TransferHandle(self._agent, None, 0, 0, self._peers[peer].transport)
        remote_rows, local_rows = xfer_arrays(plan, remote, self.descriptor)
        local_kind = mem_type(self.descriptor.allocations[0].device)[0]
        remote_kind = mem_type(remote.allocations[0].device)[0]
        with _nixl(f"prepare the READ with peer {peer!r}"):
            local = self._agent.get_xfer_descs(local_rows, local_kind)
            far = self._agent.get_xfer_descs(remote_rows, remote_kind)
            handle = self._agent.initialize_xfer("READ", local, far, peer)
        return self._start("READ", peer, handle, runs, sum(p.nbytes for p in plan))

    def _ids(self, op: str, peer: str, local_ids: Any, remote_ids: Any) -> tuple[torch.Tensor, ...]:
        """(local ids, remote ids), checked (local ones against the cache's size now, the peer's
        against the size it stated when it connected); a READ writes the local side."""
        far = self._peers[peer].descriptor.num_blocks
        return paired_ids((local_ids, self.kv_cache.num_blocks, "local block id", False),
                          (remote_ids, far, f"block id of peer {peer!r}", False), first_is_src=op != "READ")

    def _start(self, op: str, peer: str, handle: Any, runs: int, nbytes: int) -> TransferHandle:
        """Post a NIXL transfer handle; a refusal releases it and raises :class:`TransferError`."""
        cause: Exception | None = None
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # NOTE: NIXL raises its own binding exceptions
            state, cause = repr(exc), exc
        if state not in ("DONE", "PROC"):
            with contextlib.suppress(Exception):  # NOTE: the refusal below is what the caller needs
                self._agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL could not start the {op} with peer {peer!r} ({state}); {_RECONNECT}") from cause
        started = TransferHandle(self._agent, handle, runs, nbytes, self._peers[peer].transport)
        with contextlib.suppress(Exception):  # NOTE: older NIXL builds lack the query: None then
            started.backend = self._agent.query_xfer_backend(handle)
        return started

    def _forget(self, peer: str) -> None:
        """Release ``peer``'s prepared lists (``_LOCAL``: this side's) and remove the peer (errors
        of a dead peer are ignored)."""
        for key in [k for k in self._prepared if k[0] == peer]:
            with contextlib.suppress(Exception):  # NOTE: a dead peer's list may be gone already
                self._prepared.pop(key).release()
        if self._peers.pop(peer, None) is not None:
            with contextlib.suppress(Exception):  # NOTE: a peer that died cannot be told
                self._agent.remove_remote_agent(peer)

    def close(self) -> None:
        """Forget the peers and deregister the allocation (errors of a dead peer are ignored)."""
        for peer in [*self._peers, _LOCAL]:
            self._forget(peer)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
