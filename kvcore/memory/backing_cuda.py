"""CUDA backing memory through the driver's virtual memory API (``cuda-bindings``): one
reserved range wrapped once as a tensor, one physical handle per committed granule."""

from __future__ import annotations

from typing import Any

import torch

from kvcore._units import format_bytes
from kvcore.errors import InsufficientMemoryError, KVCoreError
from kvcore.memory.backing_base import BackingMemory
from kvcore.memory.layout import merge_ranges, round_up

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


def _call(driver: Any, name: str, *args: Any) -> Any:
    """Call ``driver.<name>(*args)``: the value(s) after its ``CUresult``, else KVCoreError."""
    result = getattr(driver, name)(*args)
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        error = driver.cuGetErrorName(err)[1]
        raise KVCoreError(f"{name} failed: {error.decode() if isinstance(error, bytes) else error}")
    return values[0] if len(values) == 1 else values or None


class _Reservation:
    """The reserved range, as torch reads it (``__cuda_array_interface__`` of its first
    ``nbytes``), and each committed granule's physical handle; frees all when dropped."""

    def __init__(self, driver: Any, base: int, size: int, granularity: int, nbytes: int) -> None:
        self.driver, self.base, self.size, self.granularity = driver, base, size, granularity
        self.handles: dict[int, Any] = {}  # granule offset -> physical handle
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|i1",
            "data": (base, False),
            "strides": None,
            "version": 2,
        }

    def unmap(self, offset: int) -> None:
        d = self.driver
        _call(d, "cuMemUnmap", d.CUdeviceptr(self.base + offset), self.granularity)
        _call(d, "cuMemRelease", self.handles.pop(offset))

    def __del__(self) -> None:
        d = self.driver
        try:
            for offset in list(self.handles):
                self.unmap(offset)
            d.cuMemAddressFree(d.CUdeviceptr(self.base), self.size)
        except Exception:  # NOTE: interpreter shutdown may have unloaded the driver already
            pass


class CudaBacking(BackingMemory):
    """A reserved device address range, committed in the device's allocation granules."""

    def __init__(self, size: int, device: torch.device) -> None:
        d = driver_module()
        self._driver = d
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # NOTE: makes torch's primary context current here
            _call(d, "cuInit", 0)
            on_device = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop = d.CUmemAllocationProp()
            self._prop = prop
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = on_device
            prop.location.id = index
            access = d.CUmemAccessDesc()
            self._access = access
            access.location.type = on_device
            access.location.id = index
            access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            g = int(_call(d, "cuMemGetAllocationGranularity", prop, flag))
            self.granularity = g
            self.size = round_up(size, g)
            try:
                base = _call(d, "cuMemAddressReserve", self.size, g, 0, 0)
            except KVCoreError as exc:
                raise KVCoreError(f"cannot reserve {format_bytes(self.size)} of device "
                                  f"address space ({exc}); lower max_num_blocks") from exc
            self._res = _Reservation(d, int(base), self.size, g, size)
            # NOTE: torch asks the driver which device the pointer lives on, which needs memory
            # mapped there: the first granule (block 0 of the first layer in every layout) is.
            self.tensor = torch.empty(0, dtype=torch.int8, device=self.device)
            self.commit(0, g)
            try:
                self.tensor = torch.as_tensor(self._res, device=self.device)
            except (RuntimeError, TypeError, ValueError) as exc:  # NOTE: torch reads it via numpy
                raise KVCoreError(f"torch could not wrap the reserved device range as a tensor ({exc}); "
                                  "install numpy, which torch needs to read __cuda_array_interface__") from exc
            self.tensor[:g].zero_()

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
                    handle = _call(d, "cuMemCreate", g, self._prop, 0)
                    address = d.CUdeviceptr(res.base + offset)
                    try:
                        _call(d, "cuMemMap", address, g, 0, handle, 0)
                    except KVCoreError:
                        d.cuMemRelease(handle)
                        raise
                    res.handles[offset] = handle
                    done.append(offset)
                    _call(d, "cuMemSetAccess", address, g, [self._access], 1)
            except KVCoreError as exc:
                for offset in done:
                    res.unmap(offset)
                raise InsufficientMemoryError(f"cannot commit {format_bytes(end - start)} of KV cache on {self.device} "
                                              f"({exc}); resize to fewer blocks or free device memory") from exc
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
