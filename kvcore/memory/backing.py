"""An elastic cache's memory: address space reserved once as one int8 tensor, committed and
released in whole granules (CPU here, CUDA in ``backing_cuda``; the README explains both)."""

from __future__ import annotations

import mmap

import torch

from kvcore._units import format_bytes
from kvcore.errors import KVCoreError
from kvcore.memory.backing_base import BackingMemory
from kvcore.memory.budget import available_host_memory as _available_host_memory
from kvcore.memory.layout import round_up

# NOTE: the mmap module names MAP_NORESERVE only from Python 3.13.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


class CpuBacking(BackingMemory):
    """A private ``MAP_NORESERVE`` mapping: pages are backed when first touched and released
    with ``madvise(MADV_DONTNEED)``; ``commit`` checks the system has the memory."""

    def __init__(self, size: int, granularity: int | None = None) -> None:
        page = mmap.PAGESIZE
        granularity = page if granularity is None else granularity
        if granularity <= 0 or granularity % page:
            raise ValueError(
                f"granularity must be a positive multiple of the {page}-byte page, "
                f"got {granularity}"
            )
        self.granularity = granularity
        self.size = round_up(size, granularity)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        try:
            self._map = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise KVCoreError(
                f"cannot reserve {format_bytes(self.size)} of address space ({exc}); "
                "lower max_num_blocks"
            ) from exc
        # NOTE: the tensor keeps the mapping alive (frombuffer holds the buffer export).
        self.tensor = torch.frombuffer(self._map, dtype=torch.int8, count=size)

    def commit(self, start: int, end: int) -> None:
        self.check_range(start, end)
        available = _available_host_memory()
        if available is not None and end - start > available:
            raise KVCoreError(
                f"cannot commit {format_bytes(end - start)} of KV cache: the system has "
                f"{format_bytes(available)} available; resize to fewer blocks or free memory"
            )

    def decommit(self, start: int, end: int) -> None:
        self.check_range(start, end)
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def reserve_backing(
    size: int, device: torch.device, granularity: int | None = None
) -> BackingMemory:
    """Reserve ``size`` bytes on a CPU or CUDA ``device``, nothing committed yet
    (``granularity``, CPU only, coarsens the commit unit, e.g. to rehearse a GPU's)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuBacking(size, granularity)
    if device.type != "cuda":
        raise KVCoreError(
            f"an elastic KV cache (max_num_blocks) needs a CPU or CUDA device, got "
            f"{str(device)!r}; drop max_num_blocks or use one of those"
        )
    if granularity is not None:
        raise ValueError(
            "granularity applies to CPU caches only; a GPU commits at its driver's granularity"
        )
    from kvcore.memory.backing_cuda import CudaBacking

    return CudaBacking(size, device)
