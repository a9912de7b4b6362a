"""HostKVPool: a host mirror of KV cache blocks, each host slot one block's runs back to back;
blocks of equal, aligned runs are gathered on the device in host-slot order first."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer.descriptor import describe, raw_allocation
from kvcore.transfer.pairs import PairedRuns, merge_pairs, packed_patterns, pair_runs
from kvcore.transfer.regions import BlockPattern, group_selection, paired_ids, whole_block_patterns

#: Bytes gathered per chunk: large copies, and enough chunks to overlap gather and copy.
CHUNK_BYTES = 32 << 20
#: Device staging buffers in flight: at most this many chunks of device memory per call.
RING_BUFFERS = 3


def _copy_runs(device: torch.Tensor, host: torch.Tensor, copies: PairedRuns, to_host: bool) -> None:
    """Copy runs between ``device`` (``src_offsets``) and ``host`` (``dst_offsets``)."""
    asynchronous = device.is_cuda
    runs = zip(copies.src_offsets.tolist(), copies.dst_offsets.tolist(), copies.lengths.tolist())
    for d, h, n in runs:
        if to_host:
            host[h : h + n].copy_(device[d : d + n], non_blocking=asynchronous)
        else:
            device[d : d + n].copy_(host[h : h + n], non_blocking=asynchronous)


class CopyHandle:
    """Completion of a batch of copies issued on one stream; :meth:`wait` blocks until done."""

    def __init__(self, event: torch.cuda.Event | None, runs: int, nbytes: int) -> None:
        self._event, self.num_runs, self.nbytes = event, runs, nbytes

    def done(self) -> bool:
        """Whether the copies are done (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


def _staging(patterns: tuple[BlockPattern, ...], buffer: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor] | None:
    """Blocks of equal, aligned runs as rows of a table over ``buffer`` (flat int8, viewed in
    the widest integer dividing a run): ``(table, rows per block stride, run starts in rows)``,
    else None."""
    if len(patterns) != 1:
        return None
    p = patterns[0]
    run = p.lengths[0]
    if any(n != run for n in p.lengths) or p.block_stride % run or any(s % run for s in p.starts):
        return None
    wide = next((dtype for dtype in (torch.int64, torch.int32, torch.int16)
                 if run % dtype.itemsize == 0 and buffer.data_ptr() % dtype.itemsize == 0),
                torch.int8)
    table = buffer[: buffer.numel() // run * run].view(-1, run).view(wide)
    return table, p.block_stride // run, torch.tensor(p.starts, dtype=torch.int64) // run


class HostKVPool:
    """``num_host_blocks`` host slots (pinned on CUDA) mirroring manager blocks of ``kv_cache``.

    ``group_id`` limits a call to one KV cache group's layers (default: every group, the
    whole block); restore with the one used to offload. ``staging=False`` copies run by run.
    """

    def __init__(self, kv_cache: KVCache, num_host_blocks: int, *, staging: bool = True) -> None:
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"HostKVPool needs a kvcore.KVCache, got {type(kv_cache).__name__}")
        self.num_host_blocks = positive_int("num_host_blocks", num_host_blocks)
        self.kv_cache, self.staging, self.device = kv_cache, bool(staging), kv_cache.device
        self.descriptor = describe(kv_cache)
        self._device_buf = raw_allocation(kv_cache)
        #: group ids -> (patterns, staging), worked out on first use (the cache is fixed)
        self._layouts: dict[tuple[int, ...], tuple[tuple[BlockPattern, ...], Any]] = {}
        self.block_bytes = 0
        for group_id in [None, *(g.group_id for g in self.descriptor.groups if g.layers)]:
            with contextlib.suppress(ValueError):  # NOTE: groups at other strides move one by one
                slot = sum(p.block_bytes for p in self._layout(group_id)[0])
                self.block_bytes = max(self.block_bytes, slot)
        self.host = torch.zeros(self.num_host_blocks * self.block_bytes, dtype=torch.int8,
                                pin_memory=self.device.type == "cuda")
        self._stream: torch.cuda.Stream | None = None

    def _layout(self, group_id: int | None) -> tuple[tuple[BlockPattern, ...], Any]:
        """The block patterns of a group selection and their staging (:func:`_staging`)."""
        groups = group_selection(self.descriptor, group_id)  # NOTE: checks group_id
        if groups not in self._layouts:
            patterns = whole_block_patterns(self.descriptor, groups)
            self._layouts[groups] = (patterns, _staging(patterns, self._device_buf))
        return self._layouts[groups]

    def host_block(self, host_id: int) -> torch.Tensor:
        """The bytes of host slot ``host_id`` (a view of the mirror)."""
        if type(host_id) is not int or not 0 <= host_id < self.num_host_blocks:
            raise ValueError(f"host block {host_id!r} is not an integer in [0, {self.num_host_blocks})")
        return self.host[host_id * self.block_bytes : (host_id + 1) * self.block_bytes]

    def offload(self, device_ids: Any, host_ids: Any, *, group_id: int | None = None,
                non_blocking: bool = False) -> CopyHandle:
        """Copy device blocks ``device_ids`` into host slots ``host_ids`` (pairwise); returns
        once done unless ``non_blocking`` (then ``wait()`` before reading the host slots)."""
        return self._move(device_ids, host_ids, group_id, to_host=True, non_blocking=non_blocking)

    def restore(self, host_ids: Any, device_ids: Any, *, group_id: int | None = None,
                non_blocking: bool = False) -> CopyHandle:
        """Copy host slots ``host_ids`` back into device blocks ``device_ids`` (pairwise)."""
        return self._move(device_ids, host_ids, group_id, to_host=False, non_blocking=non_blocking)

    def _move(self, device_ids: Any, host_ids: Any, group_id: int | None, *, to_host: bool,
              non_blocking: bool) -> CopyHandle:
        # NOTE: the cache's size now (an elastic cache may have shrunk since this pool was made);
        # a separate state region's groups keep their own, fixed size
        groups = group_selection(self.descriptor, group_id)
        state = bool(groups) and self.descriptor.group(groups[0]).num_blocks is not None
        num_blocks = self.descriptor.num_blocks_of(groups[0]) if state else self.kv_cache.num_blocks
        dev, host = paired_ids((device_ids, num_blocks, "device block id", False),
                               (host_ids, self.num_host_blocks, "host block id", True), first_is_src=to_host)
        patterns, staging = self._layout(group_id)
        if self.staging and staging is not None and dev.numel():
            plan = self._staged_copy(staging, dev, host, to_host=to_host)
        else:
            plan = pair_runs(patterns, dev, packed_patterns(patterns), host)
            for copies in plan:
                _copy_runs(self._device_buf, self.host, copies, to_host)
        event = torch.cuda.current_stream().record_event() if self.device.type == "cuda" else None
        handle = CopyHandle(event, sum(p.num_runs for p in plan), sum(p.nbytes for p in plan))
        if not non_blocking:
            handle.wait()
        return handle

    def _staged_copy(self, staging: tuple, device_ids: torch.Tensor, host_ids: torch.Tensor, *,
                     to_host: bool) -> list[PairedRuns]:
        """Gather (or scatter) blocks of a :func:`_staging` table chunk by chunk through a ring
        of device buffers; returns the host copies of each chunk.

        Offload: chunk ``k`` is gathered into buffer ``k % R`` on the caller's stream while
        the copy stream moves chunk ``k - 1`` to the host; a buffer is reused only after an
        event of the stream done with it (streams wait, never the host). Restore mirrors it.
        """
        table, stride_rows, starts = staging
        run_bytes = table.shape[1] * table.element_size()
        block = run_bytes * starts.numel()
        order = torch.argsort(host_ids, stable=True)  # host-slot order: consecutive slots merge
        rows = device_ids[order, None] * stride_rows + starts[None, :]
        per_chunk = max(1, CHUNK_BYTES // block)
        plan = []
        for hosts in host_ids[order].split(per_chunk):
            offsets = torch.arange(hosts.numel(), dtype=torch.int64) * block
            lengths = torch.full_like(offsets, block)
            plan.append(PairedRuns(0, 0, *merge_pairs(offsets, hosts * self.block_bytes, lengths)))
        cuda = self.device.type == "cuda"
        # NOTE: one pinned upload of every chunk's row ids; a pageable one would sync the stream.
        rows = rows.pin_memory().to(self.device, non_blocking=True) if cuda else rows
        main = torch.cuda.current_stream(self.device) if cuda else None
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream if cuda else None
        ring = [torch.empty(min(per_chunk, len(rows)) * block, dtype=torch.int8, device=self.device)
                for _ in range(min(RING_BUFFERS, len(plan)))]
        free: list[torch.cuda.Event | None] = [None] * len(ring)
        if cuda:
            side.wait_stream(main)  # the caller's writes to the cache, and the ring's earlier users
        for k, (ids, copies) in enumerate(zip(rows.split(per_chunk), plan)):
            slot = k % len(ring)
            ids = ids.reshape(-1)
            flat = ring[slot][: ids.numel() * run_bytes]
            packed = flat.view(table.dtype).view(-1, table.shape[1])
            if to_host:
                if free[slot] is not None:
                    main.wait_event(free[slot])  # the copy out of this buffer is done
                torch.index_select(table, 0, ids, out=packed)  # overlaps the previous chunk's copy
                if cuda:
                    side.wait_stream(main)
                with torch.cuda.stream(side):
                    _copy_runs(flat, self.host, copies, to_host=True)
                free[slot] = side.record_event() if cuda else None
            else:
                with torch.cuda.stream(side):
                    if free[slot] is not None:
                        side.wait_event(free[slot])  # the scatter out of this buffer is done
                    _copy_runs(flat, self.host, copies, to_host=False)
                if cuda:
                    main.wait_stream(side)
                table.index_copy_(0, ids, packed)  # overlaps the next chunk's copy
                free[slot] = main.record_event() if cuda else None
        if cuda:
            for buffer in ring:
                buffer.record_stream(side)
            main.wait_stream(side)  # later work on the caller's stream runs after the copies
        return plan
