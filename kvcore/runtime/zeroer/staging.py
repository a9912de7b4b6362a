"""Host block ids on their way to the kernel (CUDA): one persistent pinned buffer and its device copy.

Ids are written into the next free part of a page-locked host buffer and
copied, asynchronously, to the same place of a device buffer, where the
kernel reads them: no allocation, no device sync per call. A part is written
again only after the device has finished what was enqueued while it was last
in use (a CUDA event per part, recorded when the part is left): the host waits
only when it runs a whole buffer ahead of the device. A change of stream
leaves the part first. A list longer than a part grows both buffers
geometrically (once, after a device sync). Host ids are never staged during
CUDA graph capture: the graph would keep them.
"""

from __future__ import annotations

from array import array

import torch

#: Parts of the buffer (event granularity), and ids per part at first.
PARTS, PART_IDS = 4, 4096
#: Ids are placed at multiples of this (128 bytes), so every staged list is 16-byte aligned.
ALIGN = 16


def current_stream_id(index: int) -> int:
    """The raw handle of the current CUDA stream of device ``index`` (cheap: no Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class HostIdStaging:
    """The buffers of one zeroer; ``stage(ids)`` returns the device tensor holding them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        self._events = [torch.cuda.Event() for _ in range(PARTS)]
        self._stream_id: int | None = None
        self._stream: torch.cuda.Stream | None = None
        self._allocate(PART_IDS)

    def _allocate(self, part_ids: int) -> None:
        self.part_ids = part_ids
        self.pinned = torch.zeros(PARTS * part_ids, dtype=torch.int64, pin_memory=True)
        self.mirror = torch.zeros(PARTS * part_ids, dtype=torch.int64, device=self.device)
        #: The pinned buffer as an int64 memoryview: a list is written into it with no tensor built.
        self._host = memoryview(self.pinned.numpy()).cast("B").cast("q")
        self._recorded = [False] * PARTS
        self._part = self._used = 0

    def refuse_capture(self) -> None:
        """``ValueError`` during CUDA graph capture: host ids would be baked into the graph."""
        if self._capturing():
            raise ValueError(
                "host block ids cannot be zeroed inside CUDA graph capture (the graph would keep "
                "stale ids); write them into zeroer.block_id_buffer(n) and capture zero_block_ids(buf[:n])"
            )

    def stage(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Copy checked ``ids`` to the device buffer (async, current stream); the device slice holding them."""
        n = len(ids)
        stream_id = current_stream_id(self.device.index)
        if n > self.part_ids:
            torch.cuda.synchronize(self.device)  # NOTE: rare: the old buffers may still feed queued work
            self._allocate(max(2 * self.part_ids, -(-n // ALIGN) * ALIGN))
        if stream_id != self._stream_id:
            if self._stream is not None:
                self._leave_part()  # NOTE: close the work of the old stream under its own event
            self._stream_id, self._stream = stream_id, torch.cuda.current_stream(self.device)
        if self._used + n > self.part_ids:
            self._leave_part()
        start = self._part * self.part_ids + self._used
        self._used += -(-n // ALIGN) * ALIGN
        if isinstance(ids, torch.Tensor):
            self.pinned[start : start + n].copy_(ids)
        else:
            self._host[start : start + n] = array("q", ids)
        staged = self.mirror[start : start + n]
        staged.copy_(self.pinned[start : start + n], non_blocking=True)
        return staged

    def _leave_part(self) -> None:
        """Record the current part's event, move to the next part and wait until it is free."""
        self._events[self._part].record(self._stream)
        self._recorded[self._part] = True
        self._part, self._used = (self._part + 1) % PARTS, 0
        if self._recorded[self._part]:
            self._events[self._part].synchronize()  # NOTE: blocks only a whole buffer behind the host
