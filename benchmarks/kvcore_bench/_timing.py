"""Timing for the benchmarks: host and CUDA-event medians, memset, an empty launch."""

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

    ``gpu_us``: device time between CUDA events after an L2 flush; ``wall_us``: the host call
    up to a device sync; ``host_us``: the host call until it returns (no sync: what a step loop
    waits for). On CPU all three are wall times.
    """

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup
        cuda = device.type == "cuda"
        self._flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if cuda else None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def samples_us(self, fn: Callable[[], object], synced: bool = True) -> list[float]:
        """``repeats`` host times of ``fn`` after ``warmup`` untimed calls."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.sync()  # NOTE: outside the timed span, so no call waits on a full launch queue
            start = time.perf_counter()
            fn()
            if synced:
                self.sync()
            times.append((time.perf_counter() - start) * 1e6)
        self.sync()
        return times

    def wall_us(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.samples_us(fn))

    def host_us(self, fn: Callable[[], object]) -> float:
        return statistics.median(self.samples_us(fn, synced=False))

    def gpu_us(self, fn: Callable[[], object]) -> float:
        return self.gpu_group_us([fn])[0]

    def gpu_group_us(self, fns: list[Callable[[], object]],
                     repeats: int | None = None) -> list[float]:
        """Median device times of ``fns`` timed in alternation, so drift weighs on all alike."""
        if self._flush is None:
            return [self.wall_us(fn) for fn in fns]
        for _ in range(self.warmup):
            for fn in fns:
                fn()
        events: list[list] = [[] for _ in fns]
        for _ in range(repeats or self.repeats):
            for fn, out in zip(fns, events):
                self._flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
        self.sync()
        return [statistics.median(s.elapsed_time(e) * 1e3 for s, e in out) for out in events]


def find_memset() -> tuple[Callable[[int, int], None], str] | None:
    """``(memset(address, nbytes), how)`` writing zeros on the current stream, or None."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13",
             "libcudart.so.12"]
    for pattern in ("torch/lib/libcudart*.so*", "nvidia/cuda_runtime/lib/libcudart.so*",
                    "nvidia/cu*/lib/libcudart.so*"):
        names += sorted(glob.glob(os.path.join(site, pattern)))
    candidates = [(name, "cudaMemsetAsync") for name in names if name]
    for name, symbol in [*candidates, ("libcuda.so.1", "cuMemsetD8Async")]:
        try:
            fn = getattr(ctypes.CDLL(name), symbol)
        except (OSError, AttributeError):
            continue
        # NOTE: (pointer, byte value, count, stream) in both; the value travels as an int.
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int

        def memset(address: int, nbytes: int, fn=fn, symbol=symbol) -> None:
            if fn(address, 0, nbytes, torch.cuda.current_stream().cuda_stream):
                raise RuntimeError(f"{symbol} failed")

        return memset, f"{symbol} ({os.path.basename(name)})"
    return None


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
