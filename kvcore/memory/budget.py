"""How much device memory an engine may claim, from a snapshot taken at startup."""

from __future__ import annotations

import math
import os

import attrs
import torch

from kvcore._validate import attrs_non_negative, non_negative_int


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f}"


def available_host_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@attrs.frozen
class MemorySnapshot:
    """Total and free bytes of one device at one moment (CPU: system memory)."""

    device: torch.device = attrs.field(converter=torch.device)
    total_memory: int = attrs.field(validator=attrs_non_negative)
    free_memory: int = attrs.field(validator=attrs_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.free_memory > self.total_memory:
            raise ValueError(f"free_memory ({self.free_memory} bytes) exceeds total_memory "
                             f"({self.total_memory} bytes); measure both at the same moment")

    @classmethod
    def measure(cls, device: torch.device | str | int = "cpu") -> MemorySnapshot:
        """Measure ``device`` now: ``torch.cuda.mem_get_info`` for CUDA, host memory for CPU."""
        device = torch.device(device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
        elif device.type == "cpu":
            page = os.sysconf("SC_PAGE_SIZE")
            total = page * os.sysconf("SC_PHYS_PAGES")
            # NOTE: free pages undercount memory the kernel would hand back (caches).
            free = available_host_memory() or page * os.sysconf("SC_AVPHYS_PAGES")
        else:
            raise ValueError(f"cannot measure memory of device {device}; use a cuda or cpu device")
        return cls(device, int(total), int(free))


def request_memory(snapshot: MemorySnapshot, gpu_memory_utilization: float, external_weight_memory: int = 0) -> int:
    """Bytes this engine may use: ``gpu_memory_utilization`` of the device's total, less
    weights held by another process; ``ValueError`` when that is not there to take."""
    if not isinstance(snapshot, MemorySnapshot):
        raise TypeError(f"snapshot must be a MemorySnapshot, got {snapshot!r}")
    utilization = gpu_memory_utilization
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
        raise TypeError(f"gpu_memory_utilization must be a number, got {utilization!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}; it "
                         "is the fraction of the device's total memory the engine may use")
    external = non_negative_int("external_weight_memory", external_weight_memory)
    dev, total, free = snapshot.device, snapshot.total_memory, snapshot.free_memory
    budget = math.ceil(total * utilization)
    own = budget - external
    if external and own <= 0:
        raise ValueError(f"weights held outside this process on {dev} take {_gib(external)} GiB, no less than the "
                         f"whole budget of {_gib(budget)} GiB (gpu_memory_utilization={utilization} of "
                         f"{_gib(total)} GiB); raise gpu_memory_utilization or free memory held by other processes")
    if free < own:
        besides = f" besides the {_gib(external)} GiB of external weights" if external else ""
        raise ValueError(f"{dev} has {_gib(free)} of {_gib(total)} GiB free at startup, less than the "
                         f"{_gib(own)} GiB this engine needs{besides} (gpu_memory_utilization={utilization}); "
                         "lower gpu_memory_utilization or free memory held by other processes")
    return own
