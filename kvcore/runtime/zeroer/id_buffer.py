"""Host block ids on their way to the kernel (CUDA): one persistent pinned buffer and its device copy.

A list goes into the next free stretch of the pinned buffer and one async copy takes it to the same
place on the device. Each of the ``PARTS`` parts is rewritten only after the device passed the event
recorded when it was last left (so the host waits only a whole buffer ahead); a stream change leaves
the part. A list longer than a part grows both buffers geometrically, after one device sync.
"""

from __future__ import annotations

from array import array

import torch

#: Parts (one event each), ids per part at first, and the id alignment of a staged list (16 ids: 128 bytes).
PARTS, PART_IDS, ALIGN = 4, 4096, 16
#: The raw handle of device ``index``'s current CUDA stream (no Stream object built).
current_stream_id = getattr(torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream)


class IdBuffer:
    """The buffers of one zeroer; :meth:`stage` returns the device slice holding the ids."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        self._events = [torch.cuda.Event() for _ in range(PARTS)]
        self._stream_id, self._stream = None, None
        self._allocate(PART_IDS)

    def _allocate(self, part_ids: int) -> None:
        self.part_ids = part_ids
        self.pinned = torch.zeros(PARTS * part_ids, dtype=torch.int64, pin_memory=True)
        self.mirror = torch.zeros(PARTS * part_ids, dtype=torch.int64, device=self.device)
        self._host = memoryview(self.pinned.numpy()).cast("B").cast("q")  # NOTE: lists are written with no tensor
        self._recorded, self._part, self._used = [False] * PARTS, 0, 0

    def refuse_capture(self) -> None:
        """``ValueError`` during CUDA graph capture: host ids would be baked into the graph."""
        if self._capturing():
            raise ValueError("host block ids cannot be zeroed inside CUDA graph capture (the graph would keep stale "
                             "ids); write them into zeroer.block_id_buffer(n) and capture zero_block_ids(buf[:n])")

    def stage(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Copy checked ``ids`` to the device buffer (async, on the current stream)."""
        n, stream_id = len(ids), current_stream_id(self.device.index)
        if n > self.part_ids:
            torch.cuda.synchronize(self.device)  # NOTE: rare; the old buffers may still feed queued work
            self._allocate(max(2 * self.part_ids, -(-n // ALIGN) * ALIGN))
        if stream_id != self._stream_id:
            if self._stream is not None:
                self._leave_part()  # NOTE: the old stream's work ends the part, under its own event
            self._stream_id, self._stream = stream_id, torch.cuda.current_stream(self.device)
        if self._used + n > self.part_ids:
            self._leave_part()
        start = self._part * self.part_ids + self._used
        self._used += -(-n // ALIGN) * ALIGN
        if isinstance(ids, torch.Tensor):
            self.pinned[start : start + n].copy_(ids)
        else:
            self._host[start : start + n] = array("q", ids)
        return self.mirror[start : start + n].copy_(self.pinned[start : start + n], non_blocking=True)

    def _leave_part(self) -> None:
        self._events[self._part].record(self._stream)
        self._recorded[self._part] = True
        self._part, self._used = (self._part + 1) % PARTS, 0
        if self._recorded[self._part]:
            self._events[self._part].synchronize()  # NOTE: blocks only a whole buffer behind the host
