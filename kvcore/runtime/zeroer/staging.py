"""A persistent pinned staging ring for host block ids (CUDA).

``zero_block_ids(list)`` must neither allocate pinned memory nor wait for the
device on every call. Ids are written into a ring of page-locked host memory
and copied, asynchronously, into a device mirror of that ring; the kernel
reads them there (``mode="copy"``) or straight from the pinned ring
(``mode="mapped"``: no copy, the GPU reads host memory over the bus).

A region of the ring is written again only after the device has finished with
it: the ring has ``PARTS`` parts; leaving a part records a CUDA event on the
stream, and entering a part waits for the event recorded when it was last left
(a wait that only blocks when the device runs a whole ring behind the host).
A change of stream ends the part on the old stream first. Host ids are never
staged during CUDA graph capture (they would be baked into the graph).

The copy is one ``cuMemcpyHtoDAsync`` through the CUDA driver (a few
microseconds of host time less than ``Tensor.copy_``); where the driver
library cannot be loaded or refuses the call, ``Tensor.copy_`` does it.
"""

from __future__ import annotations

import ctypes
from array import array

import torch

#: Ids per slot: a list of at most this many ids is one 512-byte copy.
SLOT = 64
#: Slots in the ring, and parts (event granularity) it is split into.
SLOTS, PARTS = 256, 4
MODES = ("copy", "mapped")


def _driver_copy():
    """``cuMemcpyHtoDAsync(dst, src, nbytes, stream) -> CUresult``, or None without the driver library."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class HostIdStaging:
    """The ring of one zeroer; ``stage(ids)`` returns ``(buffer, offset)`` for the kernel."""

    def __init__(self, device: torch.device, mode: str = "copy") -> None:
        if mode not in MODES:
            raise ValueError(f"Unsupported id staging mode: {mode!r}. Supported: {list(MODES)}")
        self.device, self.mode = device, mode
        capacity = SLOT * SLOTS
        self.pinned = torch.zeros(capacity, dtype=torch.int64, pin_memory=True)
        self._host_address = self.pinned.data_ptr()
        #: The pinned ring as a writable int64 memoryview (ids are written with no foreign call).
        self._ring = memoryview((ctypes.c_int64 * capacity).from_address(self._host_address)).cast("B").cast("q")
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        self.mirror = torch.zeros(capacity, dtype=torch.int64, device=device) if mode == "copy" else None
        self.buffer = self.mirror if mode == "copy" else self.pinned
        self._pinned_slots = list(self.pinned.split(SLOT))
        self._mirror_slots = list(self.mirror.split(SLOT)) if self.mirror is not None else []
        self._mirror_address = self.mirror.data_ptr() if self.mirror is not None else 0
        self._driver_copy = _driver_copy() if self.mirror is not None else None
        self._slots_per_part = SLOTS // PARTS
        self._events = [torch.cuda.Event() for _ in range(PARTS)]
        self._recorded = [False] * PARTS
        self._part = self._slot = 0
        self._stream_id = None
        self._stream: torch.cuda.Stream | None = None
        self.max_ids = SLOT * self._slots_per_part

    def refuse_capture(self) -> None:
        """``ValueError`` during CUDA graph capture: host ids would be baked into the graph."""
        if self._capturing():
            raise ValueError(
                "host block ids cannot be zeroed inside CUDA graph capture (the graph would keep "
                "stale ids); write them into zeroer.block_id_buffer(n) and capture zero_block_ids(buf[:n])"
            )

    def stage(self, ids: list[int] | torch.Tensor, stream_id: int) -> int:
        """Write ``ids`` (checked already; at most ``max_ids``) into the ring; return their offset."""
        self.refuse_capture()
        n = len(ids)
        slots = -(-n // SLOT)
        if stream_id != self._stream_id:
            self._change_stream(stream_id)
        if self._slot + slots > (self._part + 1) * self._slots_per_part:
            self._enter_part((self._part + 1) % PARTS)
        first = self._slot
        self._slot = first + slots
        offset = first * SLOT
        if isinstance(ids, torch.Tensor):
            self.pinned[offset : offset + n].copy_(ids)
        else:
            self._ring[offset : offset + n] = array("q", ids)
        if self.mirror is not None:
            self._copy(first, slots, stream_id)
        return offset

    def _copy(self, first: int, slots: int, stream_id: int) -> None:
        """Enqueue the copy of ring slots ``first : first + slots`` to the device mirror."""
        offset, nbytes = first * SLOT, slots * SLOT * 8
        if self._driver_copy is not None:
            status = self._driver_copy(self._mirror_address + 8 * offset, self._host_address + 8 * offset, nbytes,
                                       stream_id)
            if status == 0:
                return
            self._driver_copy = None  # NOTE: e.g. no current context on this thread: torch copies from now on
        if slots == 1:
            self._mirror_slots[first].copy_(self._pinned_slots[first], non_blocking=True)
        else:
            span = slots * SLOT
            self.mirror[offset : offset + span].copy_(self.pinned[offset : offset + span], non_blocking=True)

    def _enter_part(self, part: int) -> None:
        """Close the current part (event on the stream in use) and wait until ``part`` is free."""
        self._events[self._part].record(self._stream)
        self._recorded[self._part] = True
        if self._recorded[part]:
            # NOTE: blocks only while the device still runs the launches of a whole ring ago.
            self._events[part].synchronize()
        self._part, self._slot = part, part * self._slots_per_part

    def __del__(self) -> None:
        # NOTE: the pinned ring goes back to torch's host allocator, which knows nothing of the
        # driver copies still queued from it: wait for them once, here, never on the hot path.
        stream = getattr(self, "_stream", None)
        if stream is not None:
            try:
                self._events[self._part].record(stream)
                self._events[self._part].synchronize()
            except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
                pass

    def _change_stream(self, stream_id: int) -> None:
        if self._stream is not None:
            # Launches so far ran on the old stream: close their part there, start a new one.
            self._enter_part((self._part + 1) % PARTS)
        self._stream = torch.cuda.current_stream(self.device)
        self._stream_id = stream_id
