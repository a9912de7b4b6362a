"""CUDA backing memory through the driver's virtual memory API (``cuda-bindings``).

The address range is reserved once with ``cuMemAddressReserve``; committing
a granule creates physical memory (``cuMemCreate``), maps it into the range
(``cuMemMap``) and grants the device access (``cuMemSetAccess``); releasing
unmaps it and frees the memory (``cuMemUnmap``, ``cuMemRelease``). Every
granule has its own physical handle, so any granule can go back on its own.
The range is handed to torch once, through ``__cuda_array_interface__``: the
tensor's address never changes, whatever is committed later.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore._units import format_bytes
from kvcore.errors import KVCoreError
from kvcore.memory.backing import BackingMemory
from kvcore.memory.layout import round_up
from kvcore.memory.elastic import merge_ranges

_REMEDY = "install the optional extra: pip install 'kvcore[elastic]' (the cuda-bindings package)"


def driver_module() -> Any:
    """``cuda.bindings.driver`` (or the older ``cuda.cuda``), else KVCoreError with the remedy."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # NOTE: cuda-python < 12.6 named the module so
        except ImportError:
            raise KVCoreError(f"an elastic KV cache on a GPU needs the CUDA driver API bindings; {_REMEDY}") from None
    return driver


def _check(driver: Any, result: Any, call: str) -> Any:
    """The value(s) of a driver call's ``(CUresult, ...)`` tuple; KVCoreError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise KVCoreError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values or None


class _Reservation:
    """The reserved range and the physical handle of each committed granule; frees all when dropped."""

    def __init__(self, driver: Any, base: int, size: int, granularity: int) -> None:
        self.driver, self.base, self.size, self.granularity = driver, base, size, granularity
        self.handles: dict[int, Any] = {}  # granule offset -> physical handle

    def unmap(self, offset: int) -> None:
        d = self.driver
        _check(d, d.cuMemUnmap(d.CUdeviceptr(self.base + offset), self.granularity), "cuMemUnmap")
        _check(d, d.cuMemRelease(self.handles.pop(offset)), "cuMemRelease")

    def __del__(self) -> None:
        d = self.driver
        try:
            for offset in list(self.handles):
                self.unmap(offset)
            d.cuMemAddressFree(d.CUdeviceptr(self.base), self.size)
        except Exception:  # NOTE: interpreter shutdown may have unloaded the driver already
            pass


class _DeviceRange:
    """What ``torch.as_tensor`` reads: the reserved range as one int8 array; keeps the reservation alive."""

    def __init__(self, reservation: _Reservation, nbytes: int) -> None:
        self.reservation = reservation
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|i1", "data": (reservation.base, False), "strides": None, "version": 2,
        }


class CudaBacking(BackingMemory):
    """A reserved device address range, committed in the device's allocation granules."""

    def __init__(self, size: int, device: torch.device) -> None:
        d = self._driver = driver_module()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # NOTE: makes torch's primary context current here
            _check(d, d.cuInit(0), "cuInit")
            prop = d.CUmemAllocationProp()
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = index
            self._prop = prop
            access = d.CUmemAccessDesc()
            access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = index
            access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = access
            flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            self.granularity = int(_check(d, d.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))
            self.size = round_up(size, self.granularity)
            try:
                base = _check(d, d.cuMemAddressReserve(self.size, self.granularity, 0, 0), "cuMemAddressReserve")
            except KVCoreError as exc:
                raise KVCoreError(f"cannot reserve {format_bytes(self.size)} of device address space ({exc}); "
                                  "lower max_num_blocks") from exc
            self._res = _Reservation(d, int(base), self.size, self.granularity)
            # NOTE: torch asks the driver which device the pointer lives on, which needs memory
            # mapped there: the first granule (block 0 of the first layer in every layout) is.
            self.tensor = torch.empty(0, dtype=torch.int8, device=self.device)
            self.commit(0, self.granularity)
            try:
                self.tensor = torch.as_tensor(_DeviceRange(self._res, size), device=self.device)
            except (RuntimeError, TypeError, ValueError) as exc:  # NOTE: torch reads the interface through numpy
                raise KVCoreError(
                    f"torch could not wrap the reserved device range as a tensor ({exc}); "
                    "install numpy, which torch needs to read __cuda_array_interface__"
                ) from exc
            self.tensor[: self.granularity].zero_()

    def commit(self, start: int, end: int) -> None:
        """Map the granules of ``[start, end)`` that are not mapped yet (the first one may be)."""
        self.check_range(start, end)
        d, res, g = self._driver, self._res, self.granularity
        done: list[int] = []
        with torch.cuda.device(self.device):
            try:
                for offset in range(start, end, g):
                    if offset in res.handles:
                        continue
                    handle = _check(d, d.cuMemCreate(g, self._prop, 0), "cuMemCreate")
                    try:
                        _check(d, d.cuMemMap(d.CUdeviceptr(res.base + offset), g, 0, handle, 0), "cuMemMap")
                    except KVCoreError:
                        d.cuMemRelease(handle)
                        raise
                    res.handles[offset] = handle
                    done.append(offset)
                    _check(d, d.cuMemSetAccess(d.CUdeviceptr(res.base + offset), g, [self._access], 1), "cuMemSetAccess")
            except KVCoreError as exc:
                for offset in done:
                    res.unmap(offset)
                raise KVCoreError(
                    f"cannot commit {format_bytes(end - start)} of KV cache on {self.device} ({exc}); "
                    "resize to fewer blocks or free device memory"
                ) from exc
            # NOTE: fresh physical memory holds stale bytes; committed memory reads as zero.
            for first, last in merge_ranges((o, o + g) for o in done):
                self.tensor[first:last].zero_()

    def decommit(self, start: int, end: int) -> None:
        self.check_range(start, end)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # NOTE: no kernel may still read what goes away
            for offset in range(start, end, self.granularity):
                if offset in self._res.handles:
                    self._res.unmap(offset)
