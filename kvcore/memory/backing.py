"""An elastic cache's memory: address space reserved once as one int8 tensor, committed and
released in whole granules (CPU here, CUDA in ``backing_cuda``; the README explains both)."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from kvcore._units import format_bytes
from kvcore.errors import InsufficientMemoryError, KVCoreError
from kvcore.memory import budget
from kvcore.memory.backing_base import BackingMemory
from kvcore.memory.layout import round_up

# NOTE: the mmap module names MAP_NORESERVE only from Python 3.13, and has no mprotect.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_LIBC = ctypes.CDLL(None, use_errno=True)


class CpuBacking(BackingMemory):
    """A private ``MAP_NORESERVE`` mapping: pages are backed when first touched and released
    with ``madvise(MADV_DONTNEED)``; ``commit`` checks the system has the memory. What is not
    committed is read-only (it reads as zero): a write there, by this process or a NIXL peer,
    fails instead of taking back memory given back."""

    def __init__(self, size: int, granularity: int | None = None) -> None:
        page = mmap.PAGESIZE
        granularity = page if granularity is None else granularity
        if granularity <= 0 or granularity % page:
            raise ValueError(f"granularity must be a positive multiple of the {page}-byte page, got {granularity}")
        self.granularity = granularity
        self.size = round_up(size, granularity)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        try:
            self._map = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise KVCoreError(f"cannot reserve {format_bytes(self.size)} of address "
                              f"space ({exc}); lower max_num_blocks") from exc
        # NOTE: the tensor keeps the mapping alive (frombuffer holds the buffer export).
        self.tensor = torch.frombuffer(self._map, dtype=torch.int8, count=size)
        self._protect(0, self.size, mmap.PROT_READ)

    def _protect(self, start: int, end: int, prot: int) -> None:
        address = ctypes.c_void_p(self.tensor.data_ptr() + start)
        if _LIBC.mprotect(address, ctypes.c_size_t(end - start), prot):
            error = os.strerror(ctypes.get_errno())
            raise InsufficientMemoryError(f"cannot change access to [{start}, {end}) of the KV "
                                          f"cache ({error}); resize to fewer blocks or free memory")

    def commit(self, start: int, end: int) -> None:
        self.check_range(start, end)
        available = budget.available_host_memory()
        if available is not None and end - start > available:
            raise InsufficientMemoryError(f"cannot commit {format_bytes(end - start)} of KV cache: the system has "
                                          f"{format_bytes(available)} available; resize to fewer blocks or free memory")
        self._protect(start, end, mmap.PROT_READ | mmap.PROT_WRITE)

    def decommit(self, start: int, end: int) -> None:
        self.check_range(start, end)
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        self._protect(start, end, mmap.PROT_READ)


def reserve_backing(size: int, device: torch.device, granularity: int | None = None) -> BackingMemory:
    """Reserve ``size`` bytes on a CPU or CUDA ``device``, nothing committed yet
    (``granularity``, CPU only, coarsens the commit unit, e.g. to rehearse a GPU's)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuBacking(size, granularity)
    if device.type != "cuda":
        raise KVCoreError("an elastic KV cache (max_num_blocks) needs a CPU or CUDA device, "
                          f"got {str(device)!r}; drop max_num_blocks or use one of those")
    if granularity is not None:
        raise ValueError("granularity applies to CPU caches only; a GPU commits at its driver's granularity")
    from kvcore.memory.backing_cuda import CudaBacking

    return CudaBacking(size, device)
