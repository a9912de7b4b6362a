"""HostKVPool: a host mirror of KV cache blocks, filled and drained by exact plans.

Host block ``h`` is a slot of ``block_bytes`` bytes holding one manager
block's runs back to back (no padding). Offload and restore copy the paired
runs of :func:`~kvcore.transfer.pairs.pair_runs`: one copy per block in a
block-outermost layout (one per streak of consecutive ids on both sides). A
block of equal runs (every layout of a plain attention model) is gathered on
the device into host-slot order first, then moved in large copies that
overlap the gather (``staging``). On CUDA the mirror is pinned and copies are
asynchronous; work queued later on the caller's stream runs after them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer.describe import describe
from kvcore.transfer.ids import paired_ids
from kvcore.transfer.pairs import PairedRuns, packed_patterns, pair_runs
from kvcore.transfer.plan import BlockPattern, block_patterns
from kvcore.transfer.staging import RING_BUFFERS, StagedPlan, run_table, staged_plan


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None, *, after: torch.cuda.Stream | None = None) -> Iterator[None]:
    """Issue work on ``stream`` (after the work queued so far on ``after``); no-op on CPU."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_stream(after)
    with torch.cuda.stream(stream):
        yield


def _event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on ``stream`` now (None on CPU, where every copy is done on return)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class CopyHandle:
    """Completion of a batch of copies issued on one stream; :meth:`wait` blocks until done."""

    def __init__(self, event: torch.cuda.Event | None, runs: int, nbytes: int) -> None:
        self._event, self.num_runs, self.nbytes = event, runs, nbytes

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


def raw_allocation(kv_cache: KVCache) -> torch.Tensor:
    """The KV cache's one backing allocation as a flat int8 tensor."""
    view = next(iter(kv_cache.kv_caches.values()))
    return torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())


def group_selection(kv_cache: KVCache, descriptor, group_id: int | None) -> tuple[int, ...]:
    """Group ids moved by one call: ``group_id``, or every group with cache views."""
    if group_id is not None:
        if not descriptor.group(group_id).layers:
            raise ValueError(f"KV cache group {group_id} has no cache pages to move")
        return (group_id,)
    return tuple(g.group_id for g in descriptor.groups if g.layers)


def whole_block_patterns(descriptor, group_ids: tuple[int, ...]) -> tuple[BlockPattern, ...]:
    """Patterns of all selected groups; refuses groups whose blocks repeat at different strides."""
    patterns = block_patterns(descriptor, group_ids, None)
    if len({p.block_stride for p in patterns}) > 1:
        raise ValueError(
            "the KV cache groups store blocks at different strides "
            f"({sorted({p.block_stride for p in patterns})} bytes), so a block id means "
            "different bytes in each; pass group_id= to move one group's blocks"
        )
    return patterns


class HostKVPool:
    """``num_host_blocks`` host slots mirroring manager blocks of ``kv_cache``.

    ``offload(device_ids, host_ids)`` copies device blocks into host slots,
    ``restore(host_ids, device_ids)`` copies them back; ``group_id`` limits a
    call to one KV cache group's layers (default: every group, the whole
    block). Restore with the ``group_id`` used to offload.
    """

    def __init__(self, kv_cache: KVCache, num_host_blocks: int, *, pin_memory: bool | None = None,
                 staging: bool = True) -> None:
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"HostKVPool needs a kvcore.KVCache, got {type(kv_cache).__name__}")
        self.num_host_blocks = positive_int("num_host_blocks", num_host_blocks)
        self.kv_cache = kv_cache
        #: Gather blocks made of many equal runs on the device first (``kvcore.transfer.staging``).
        self.staging = bool(staging)
        self.descriptor = describe(kv_cache)
        self.device = kv_cache.device
        self._device_buf = raw_allocation(kv_cache)
        selections = [None, *(g.group_id for g in self.descriptor.groups if g.layers)]
        self.block_bytes = max(self._host_side(g)[1] for g in selections if self._safe(g))
        pin = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.host = torch.zeros(self.num_host_blocks * self.block_bytes, dtype=torch.int8, pin_memory=pin)
        self._stream: torch.cuda.Stream | None = None

    def _safe(self, group_id: int | None) -> bool:
        try:
            self._device_side(group_id)
        except ValueError:
            return False
        return True

    def _device_side(self, group_id: int | None) -> tuple[BlockPattern, ...]:
        return whole_block_patterns(self.descriptor, group_selection(self.kv_cache, self.descriptor, group_id))

    def _host_side(self, group_id: int | None) -> tuple[tuple[BlockPattern, ...], int]:
        return packed_patterns(self._device_side(group_id))

    def host_block(self, host_id: int) -> torch.Tensor:
        """The bytes of host slot ``host_id`` (a view of the mirror)."""
        if type(host_id) is not int or not 0 <= host_id < self.num_host_blocks:
            raise ValueError(f"host block {host_id!r} is not an integer in [0, {self.num_host_blocks})")
        return self.host[host_id * self.block_bytes : (host_id + 1) * self.block_bytes]

    def _ids(self, device_ids: Any, host_ids: Any, to_host: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n_dev, n_host = self.descriptor.num_blocks, self.num_host_blocks
        if to_host:
            return paired_ids(device_ids, n_dev, host_ids, n_host, src_what="device block id",
                              dst_what="host block id", dst_null_ok=True)
        host, dev = paired_ids(host_ids, n_host, device_ids, n_dev, src_what="host block id",
                               dst_what="device block id", src_null_ok=True)
        return dev, host

    def plan(self, device_ids: Any, host_ids: Any, *, group_id: int | None = None,
             to_host: bool = True) -> list[PairedRuns]:
        """Validated copies between device blocks and host slots (device side = ``src``).

        Device ids exclude the null block 0; host ids are ``[0, num_host_blocks)``;
        the destination side (host when ``to_host``) may not repeat an id.
        """
        dev, host = self._ids(device_ids, host_ids, to_host)
        host_patterns, _ = self._host_side(group_id)
        return pair_runs(self._device_side(group_id), dev, host_patterns, host)

    def offload(self, device_ids: Any, host_ids: Any, *, group_id: int | None = None,
                non_blocking: bool = False) -> CopyHandle:
        """Copy device blocks ``device_ids`` into host slots ``host_ids`` (pairwise).

        Returns once the copies are done unless ``non_blocking`` (then call
        ``wait()`` on the handle before reading the host slots).
        """
        return self._move(device_ids, host_ids, group_id, to_host=True, non_blocking=non_blocking)

    def restore(self, host_ids: Any, device_ids: Any, *, group_id: int | None = None,
                non_blocking: bool = False) -> CopyHandle:
        """Copy host slots ``host_ids`` back into device blocks ``device_ids`` (pairwise)."""
        return self._move(device_ids, host_ids, group_id, to_host=False, non_blocking=non_blocking)

    def _move(self, device_ids: Any, host_ids: Any, group_id: int | None, *, to_host: bool,
              non_blocking: bool) -> CopyHandle:
        dev, host = self._ids(device_ids, host_ids, to_host)
        patterns = self._device_side(group_id)
        staged = staged_plan(patterns, dev, host, self.block_bytes) if self.staging else None
        if staged is not None:
            return self._staged_copy(staged, to_host=to_host, non_blocking=non_blocking)
        host_patterns, _ = self._host_side(group_id)
        return self._copy(pair_runs(patterns, dev, host_patterns, host), to_host=to_host, non_blocking=non_blocking)

    def _copy_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _staged_copy(self, staged: StagedPlan, *, to_host: bool, non_blocking: bool) -> CopyHandle:
        """Gather (or scatter) chunk by chunk through a ring of device buffers, overlapped with the copies.

        Offload: chunk ``k`` is gathered into ring buffer ``k % R`` on the caller's
        stream while the copy stream moves chunk ``k - 1`` to the host; a buffer is
        gathered into again only after the copy stream is done with it (an event,
        waited on by the stream, never by the host). Restore mirrors it.
        """
        table = run_table(self._device_buf, staged.run_bytes)
        cuda = self.device.type == "cuda"
        rows = torch.cat([c.rows for c in staged.chunks])
        # NOTE: one pinned upload of every chunk's row ids; a pageable one would sync the stream.
        rows = rows.pin_memory().to(self.device, non_blocking=True) if cuda else rows
        main = torch.cuda.current_stream(self.device) if cuda else None
        side = self._copy_stream() if cuda else None
        size = max(c.nbytes for c in staged.chunks)
        ring = [torch.empty(size, dtype=torch.int8, device=self.device)
                for _ in range(min(RING_BUFFERS, len(staged.chunks)))]
        free: list[torch.cuda.Event | None] = [None] * len(ring)
        if cuda:
            side.wait_stream(main)  # the caller's writes to the cache, and the ring's earlier users
        first = 0
        for k, chunk in enumerate(staged.chunks):
            ids = rows[first : first + chunk.rows.numel()]
            first += chunk.rows.numel()
            flat = ring[k % len(ring)][: chunk.nbytes]
            packed = flat.view(table.dtype).view(-1, table.shape[1])
            pieces = list(zip(chunk.copies.src_offsets.tolist(), chunk.copies.dst_offsets.tolist(),
                              chunk.copies.lengths.tolist()))
            if to_host:
                if free[k % len(ring)] is not None:
                    main.wait_event(free[k % len(ring)])  # the copy out of this buffer is done
                torch.index_select(table, 0, ids, out=packed)  # overlaps the previous chunk's copy
                with _on(side, after=main):
                    for s, h, n in pieces:
                        self.host[h : h + n].copy_(flat[s : s + n], non_blocking=cuda)
                free[k % len(ring)] = _event(side)
            else:
                with _on(side):
                    if free[k % len(ring)] is not None:
                        side.wait_event(free[k % len(ring)])  # the scatter out of this buffer is done
                    for s, h, n in pieces:
                        flat[s : s + n].copy_(self.host[h : h + n], non_blocking=cuda)
                if cuda:
                    main.wait_stream(side)
                table.index_copy_(0, ids, packed)  # overlaps the next chunk's copy
                free[k % len(ring)] = _event(main)
        if cuda:
            for buffer in ring:
                buffer.record_stream(side)
            main.wait_stream(side)  # later work on the caller's stream runs after the copies, as after a copy_
        handle = CopyHandle(None, staged.num_copies, staged.nbytes)
        return self._finish(handle, non_blocking)

    def _copy(self, plan: list[PairedRuns], *, to_host: bool, non_blocking: bool) -> CopyHandle:
        device_buf, host_buf = self._device_buf, self.host
        asynchronous = self.device.type == "cuda"
        runs = nbytes = 0
        for part in plan:
            for d, h, n in zip(part.src_offsets.tolist(), part.dst_offsets.tolist(), part.lengths.tolist()):
                if to_host:
                    host_buf[h : h + n].copy_(device_buf[d : d + n], non_blocking=asynchronous)
                else:
                    device_buf[d : d + n].copy_(host_buf[h : h + n], non_blocking=asynchronous)
            runs, nbytes = runs + part.num_runs, nbytes + part.nbytes
        return self._finish(CopyHandle(None, runs, nbytes), non_blocking)

    def _finish(self, handle: CopyHandle, non_blocking: bool) -> CopyHandle:
        if self.device.type == "cuda":
            handle._event = torch.cuda.Event()
            handle._event.record()
        if not non_blocking:
            handle.wait()
        return handle

