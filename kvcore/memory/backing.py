"""Backing memory for an elastic KV cache: reserve address space once, commit and release parts of it.

A :class:`BackingMemory` reserves ``size`` bytes of address space and exposes
them as one int8 tensor (no copy), so every view, stride and plan made for
the full reservation works unchanged. Memory is committed and released in
whole granules: :meth:`commit` and :meth:`decommit` take granule-aligned
byte ranges. Committed memory reads as zero. Bytes outside the committed
granules must never be touched.

:func:`reserve_backing` picks the implementation for a device: an anonymous
``MAP_NORESERVE`` mapping on the CPU (this module), the CUDA driver's
virtual memory API on a GPU (:mod:`kvcore.memory.backing_cuda`).
"""

from __future__ import annotations

import mmap

import torch

from kvcore._units import format_bytes
from kvcore.errors import KVCoreError

#: ``MAP_NORESERVE`` on Linux (the ``mmap`` module names it only from Python 3.13).
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BackingMemory:
    """Reserved address space, committed granule by granule (the interface)."""

    #: Bytes reserved (a multiple of :attr:`granularity`).
    size: int
    #: Bytes per granule: the unit of commit and release.
    granularity: int
    #: The whole reservation as one 1-D int8 tensor (its first ``requested`` bytes).
    tensor: torch.Tensor

    def commit(self, start: int, end: int) -> None:
        """Back bytes ``[start, end)`` (granule-aligned, not yet committed) with memory that reads as zero.

        All or nothing: on failure nothing of the range stays committed and
        :class:`~kvcore.errors.KVCoreError` says how much was asked.
        """
        raise NotImplementedError

    def decommit(self, start: int, end: int) -> None:
        """Give the memory behind ``[start, end)`` (granule-aligned, committed) back."""
        raise NotImplementedError

    def check_range(self, start: int, end: int) -> None:
        g = self.granularity
        if start % g or end % g or not 0 <= start < end <= self.size:
            raise ValueError(
                f"[{start}, {end}) is not a granule-aligned range of this {self.size}-byte "
                f"reservation (granule {g} bytes)"
            )


def _available_host_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuBacking(BackingMemory):
    """An anonymous private mapping reserved with ``MAP_NORESERVE``.

    Pages are backed when first touched; :meth:`decommit` releases them with
    ``madvise(MADV_DONTNEED)`` (resident memory drops at once, and the pages
    read as zero when touched again). :meth:`commit` only checks that the
    system has the memory available, so that a cache grows only while memory
    allows.
    """

    def __init__(self, size: int, granularity: int | None = None) -> None:
        page = mmap.PAGESIZE
        granularity = page if granularity is None else granularity
        if granularity <= 0 or granularity % page:
            raise ValueError(f"granularity must be a positive multiple of the {page}-byte page, got {granularity}")
        self.granularity = granularity
        self.size = round_up(size, granularity)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        try:
            self._map = mmap.mmap(-1, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise KVCoreError(
                f"cannot reserve {format_bytes(self.size)} of address space ({exc}); lower max_num_blocks"
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


def reserve_backing(size: int, device: torch.device, granularity: int | None = None) -> BackingMemory:
    """Reserve ``size`` bytes on ``device`` (CPU or CUDA), nothing committed yet.

    ``granularity`` (CPU only) coarsens the commit unit, e.g. to rehearse a
    GPU's 2 MiB granules on a CPU; a GPU always uses its driver's granularity.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return CpuBacking(size, granularity)
    if device.type == "cuda":
        from kvcore.memory.backing_cuda import CudaBacking

        if granularity is not None:
            raise ValueError("granularity applies to CPU caches only; a GPU commits at its driver's granularity")
        return CudaBacking(size, device)
    raise KVCoreError(
        f"an elastic KV cache (max_num_blocks) needs a CPU or CUDA device, got {str(device)!r}; "
        "drop max_num_blocks or use one of those"
    )


__all__ = ["MAP_NORESERVE", "BackingMemory", "CpuBacking", "reserve_backing", "round_up"]
