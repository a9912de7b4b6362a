"""MemorySnapshot and request_memory: budgets and the three refusals."""

from __future__ import annotations

import math

import pytest
import torch

from kvcore.memory.budget import MemorySnapshot, request_memory

GIB = 1 << 30


def test_measure_cpu_reports_system_memory():
    snap = MemorySnapshot.measure("cpu")
    assert snap.device == torch.device("cpu")
    assert 0 < snap.free_memory <= snap.total_memory
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    # sysconf and /proc/meminfo agree on total RAM to within a few percent
    assert abs(snap.total_memory - total_kib * 1024) < 0.05 * snap.total_memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_cuda_matches_mem_get_info():
    snap = MemorySnapshot.measure("cuda:0")
    assert snap.total_memory == torch.cuda.mem_get_info(0)[1]


def test_measure_unknown_device():
    with pytest.raises(ValueError, match="cannot measure memory of device meta"):
        MemorySnapshot.measure("meta")


def test_snapshot_validates():
    with pytest.raises(ValueError, match="exceeds total_memory"):
        MemorySnapshot("cpu", 10, 11)
    with pytest.raises(ValueError):
        MemorySnapshot("cpu", -1, 0)


@pytest.mark.parametrize("util", [0.3, 0.9, 1.0])
def test_budget_is_fraction_of_total(util):
    snap = MemorySnapshot("cuda:0", 80 * GIB + 12345, 80 * GIB)
    if math.ceil(snap.total_memory * util) > snap.free_memory:
        with pytest.raises(ValueError, match="lower gpu_memory_utilization"):
            request_memory(snap, util)
    else:
        assert request_memory(snap, util) == math.ceil(snap.total_memory * util)


def test_free_memory_below_budget():
    snap = MemorySnapshot("cuda:1", 80 * GIB, 20 * GIB)
    with pytest.raises(ValueError, match=r"cuda:1 has 20.00 of 80.00 GiB free.*72.00 GiB.*0.9"):
        request_memory(snap, 0.9)


def test_external_weights_are_subtracted():
    snap = MemorySnapshot("cuda:0", 80 * GIB, 60 * GIB)
    assert request_memory(snap, 0.9, external_weight_memory=16 * GIB) == math.ceil(72 * GIB) - 16 * GIB


def test_external_weights_exceed_budget():
    snap = MemorySnapshot("cuda:0", 80 * GIB, 80 * GIB)
    with pytest.raises(ValueError, match=r"take 40.00 GiB.*budget of 40.00 GiB"):
        request_memory(snap, 0.5, external_weight_memory=40 * GIB)


def test_free_memory_below_budget_after_external_weights():
    snap = MemorySnapshot("cuda:0", 80 * GIB, 30 * GIB)
    with pytest.raises(ValueError, match=r"30.00 of 80.00 GiB free.*56.00 GiB.*16.00 GiB of external"):
        request_memory(snap, 0.9, external_weight_memory=16 * GIB)


@pytest.mark.parametrize("util", [0, -0.1, 1.01, float("nan")])
def test_utilization_must_be_in_unit_interval(util):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        request_memory(MemorySnapshot("cpu", GIB, GIB), util)


def test_bad_types():
    with pytest.raises(TypeError):
        request_memory(MemorySnapshot("cpu", GIB, GIB), "0.9")
    with pytest.raises(TypeError):
        request_memory((GIB, GIB), 0.9)
    with pytest.raises(ValueError):
        request_memory(MemorySnapshot("cpu", GIB, GIB), 0.5, external_weight_memory=-1)
