"""Timing helpers for the GPU benchmarks: CUDA events, L2 flushes, memset, empty launches."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import statistics
import time
from collections.abc import Callable

import torch

#: Bytes written before each timed repeat so no run starts with a warm L2.
FLUSH_BYTES = 512 << 20


class Timer:
    """Median time of a callable, in microseconds, on one device.

    ``gpu_us`` brackets the work with CUDA events after an L2 flush (device
    time only); ``wall_us`` times the host call up to a device sync (launch
    overhead, validation and copies included); ``host_us`` times the host call
    until it returns, with no sync in the timed span (what a scheduler's step
    loop waits for). On CPU all three are wall times.
    """

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self._flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wall_us(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    def host_us(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.sync()  # NOTE: outside the timed span, so no call waits on a full launch queue
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        self.sync()
        return statistics.median(times)

    def gpu_us(self, fn: Callable[[], object]) -> float:
        if self._flush is None:
            return self.wall_us(fn)
        for _ in range(self.warmup):
            fn()
        pairs = []
        for _ in range(self.repeats):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        self.sync()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


    def gpu_group_us(self, fns: list[Callable[[], object]], repeats: int | None = None) -> list[float]:
        """Median device times of ``fns``, timed in alternation (one round of all per repeat).

        Each is preceded by an L2 flush, and clock or thermal drift over the
        run weighs on all alike: their ratios are side by side.
        """
        if self._flush is None:
            return [self.wall_us(fn) for fn in fns]
        for _ in range(self.warmup):
            for fn in fns:
                fn()
        events: list[list] = [[] for _ in fns]
        for _ in range(repeats or self.repeats):
            for fn, out in zip(fns, events):
                self._flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
        self.sync()
        return [statistics.median(s.elapsed_time(e) * 1e3 for s, e in out) for out in events]


def _cudart_candidates() -> list[str]:
    names = [ctypes.util.find_library("cudart")] + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in (f"{torch_lib}/libcudart*.so*", f"{site}/nvidia/cuda_runtime/lib/libcudart.so*",
                    f"{site}/nvidia/cu*/lib/libcudart.so*"):
        names += sorted(glob.glob(pattern))
    return [n for n in names if n]


def find_memset() -> tuple[Callable[[int, int], None], str] | None:
    """``(memset(address, nbytes), how)`` writing zeros on the current stream, or None."""
    for name in _cudart_candidates():
        try:
            fn = ctypes.CDLL(name).cudaMemsetAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int

        def cudart_memset(address: int, nbytes: int, fn=fn) -> None:
            if fn(address, 0, nbytes, torch.cuda.current_stream().cuda_stream):
                raise RuntimeError("cudaMemsetAsync failed")

        return cudart_memset, f"cudaMemsetAsync ({os.path.basename(name)})"
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemsetD8Async
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def driver_memset(address: int, nbytes: int) -> None:
        if fn(address, 0, nbytes, torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("cuMemsetD8Async failed")

    return driver_memset, "cuMemsetD8Async (libcuda.so.1)"


try:
    import triton

    @triton.jit
    def _empty_kernel(ptr):
        pass

except ImportError:  # pragma: no cover - the zeroer bench then has no Triton at all
    _empty_kernel = None


def empty_launch(device: torch.device) -> Callable[[], None] | None:
    """A launch of a Triton kernel that does nothing (the floor for one launch), or None."""
    if _empty_kernel is None:
        return None
    anchor = torch.empty(1, device=device)
    return lambda: _empty_kernel[(1,)](anchor)
