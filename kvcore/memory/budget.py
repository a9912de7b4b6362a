"""How much device memory an engine may claim, from a snapshot taken at startup."""

from __future__ import annotations

import math
import os

import attrs
import torch

from kvcore._validate import non_negative_int

_GIB = 1 << 30


def _device(value: torch.device | str | int) -> torch.device:
    return value if isinstance(value, torch.device) else torch.device(value)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f}"


def _system_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    # NOTE: free pages undercount memory the kernel would hand back (caches).
    return total, page * os.sysconf("SC_AVPHYS_PAGES")


@attrs.frozen
class MemorySnapshot:
    """Total and free bytes of one device at one moment (CPU: system memory)."""

    device: torch.device = attrs.field(converter=_device)
    total_memory: int = attrs.field()
    free_memory: int = attrs.field()

    def __attrs_post_init__(self) -> None:
        non_negative_int("total_memory", self.total_memory)
        non_negative_int("free_memory", self.free_memory)
        if self.free_memory > self.total_memory:
            raise ValueError(
                f"free_memory ({self.free_memory} bytes) exceeds total_memory "
                f"({self.total_memory} bytes); measure both at the same moment"
            )

    @classmethod
    def measure(cls, device: torch.device | str | int = "cpu") -> MemorySnapshot:
        """Measure ``device`` now: ``torch.cuda.mem_get_info`` for CUDA, host memory for CPU."""
        device = _device(device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
        elif device.type == "cpu":
            total, free = _system_memory()
        else:
            raise ValueError(f"cannot measure memory of device {device}; use a cuda or cpu device")
        return cls(device, int(total), int(free))


def request_memory(
    snapshot: MemorySnapshot,
    gpu_memory_utilization: float,
    external_weight_memory: int = 0,
) -> int:
    """Bytes this engine may use: ``gpu_memory_utilization`` of the device's total,
    less weights held by another process (``external_weight_memory``).

    Raises ``ValueError`` when the external weights alone exceed that budget,
    or when the device has less free memory than the engine would claim.
    """
    if not isinstance(snapshot, MemorySnapshot):
        raise TypeError(f"snapshot must be a MemorySnapshot, got {snapshot!r}")
    utilization = gpu_memory_utilization
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
        raise TypeError(f"gpu_memory_utilization must be a number, got {utilization!r}")
    if not 0 < utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {utilization}; "
            "it is the fraction of the device's total memory the engine may use"
        )
    external = non_negative_int("external_weight_memory", external_weight_memory)
    dev, total, free = snapshot.device, snapshot.total_memory, snapshot.free_memory
    budget = math.ceil(total * utilization)
    if external > 0:
        own = budget - external
        if own <= 0:
            raise ValueError(
                f"weights held outside this process on {dev} take {_gib(external)} GiB, "
                f"no less than the whole budget of {_gib(budget)} GiB "
                f"(gpu_memory_utilization={utilization} of {_gib(total)} GiB); raise "
                "gpu_memory_utilization or free memory held by other processes"
            )
        if free < own:
            raise ValueError(
                f"{dev} has {_gib(free)} of {_gib(total)} GiB free at startup, less than "
                f"the {_gib(own)} GiB this engine needs besides the {_gib(external)} GiB "
                f"of external weights (gpu_memory_utilization={utilization}); lower "
                "gpu_memory_utilization or free memory held by other processes"
            )
        return own
    if free < budget:
        raise ValueError(
            f"{dev} has {_gib(free)} of {_gib(total)} GiB free at startup, less than "
            f"the {_gib(budget)} GiB asked by gpu_memory_utilization={utilization}; "
            "lower gpu_memory_utilization or free memory held by other processes"
        )
    return budget
