"""KVBlockZeroer on a CUDA device: the compiled kernel, device ids, CUDA graphs.

Skipped without CUDA. Run on a GPU machine with the interpreter off:
``TRITON_INTERPRET= python -m pytest tests/test_zeroer_gpu.py -q``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

try:
    from test_zeroer import Case, _Backend, _packed_case, expected_after, fill_random, raw_bytes
except ImportError:  # pytest --import-mode=importlib
    from tests.test_zeroer import Case, _Backend, _packed_case, expected_after, fill_random, raw_bytes

from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import FullAttentionSpec

pytestmark = [
    pytest.mark.kvcore_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="GPU tests run the compiled kernel"),
]


def _cases(count: int, max_blocks: int = 40):
    return [(seed, Case(random.Random(seed), "cuda", max_blocks=max_blocks)) for seed in range(count)]


def test_random_configs_zero_exactly_the_listed_blocks():
    for seed, case in _cases(60):
        zeroer = case.zeroer("triton", "cuda")
        rng = random.Random(seed)
        ids = [rng.randrange(case.num_blocks) for _ in range(rng.randint(1, 2 * case.num_blocks))]
        before = fill_random(case.raw, seed)
        zeroer.zero_block_ids(ids)
        torch.cuda.synchronize()
        assert torch.equal(case.raw, case.expected_after(before, ids)), f"seed {seed}"


def test_repeated_launches_go_through_the_compiled_launcher_and_zero_exactly_the_listed_blocks():
    for seed, case in _cases(8):
        zeroer = case.zeroer("triton", "cuda")
        rng = random.Random(seed)
        for step in range(10):
            ids = [rng.randrange(case.num_blocks) for _ in range([1, 64, 2, 65, 130][step % 5])]
            before = fill_random(case.raw, seed * 10 + step)
            zeroer.zero_block_ids(ids if step % 2 else torch.tensor(ids, device="cuda", dtype=torch.int32))
            torch.cuda.synchronize()
            assert torch.equal(case.raw, case.expected_after(before, ids)), f"seed {seed} step {step}"
        for launcher in zeroer._launchers:
            # Short lists by value, longer ones and device tensors from memory: both compiled once, then reused.
            assert launcher._compiled is not None, f"seed {seed}: Triton's compiled launcher was given up"
            assert {key[0] for key in launcher._compiled} == {True, False}, f"seed {seed}"


def test_zeroing_block_b_changes_exactly_block_b():
    for seed, case in _cases(15, max_blocks=8):
        zeroer = case.zeroer("triton", "cuda")
        for block in range(case.num_blocks):
            before = fill_random(case.raw, seed * 100 + block)
            zeroer.zero_block_ids(torch.tensor([block], device="cuda"))
            assert torch.equal(case.raw, case.expected_after(before, [block])), f"seed {seed} block {block}"


@pytest.mark.parametrize("bad", [[-1], [10**6], [2**70], [1.0], [True], torch.tensor([0, 10**6])], ids=repr)
def test_bad_host_ids_raise_and_write_nothing(bad):
    case = Case(random.Random(1), "cuda")
    zeroer = case.zeroer("triton", "cuda")
    before = fill_random(case.raw, 9)
    with pytest.raises(ValueError, match="block id"):
        zeroer.zero_block_ids(bad)
    torch.cuda.synchronize()
    assert torch.equal(case.raw, before)


def test_device_ids_out_of_range_are_skipped_or_refused():
    case = Case(random.Random(2), "cuda")
    zeroer = case.zeroer("triton", "cuda")
    n = case.num_blocks
    before = fill_random(case.raw, 4)
    ids = torch.tensor([-5, n, n + 10**9, 1], device="cuda", dtype=torch.int64)
    with pytest.raises(ValueError, match="block id"):
        zeroer.zero_block_ids(ids, validate=True)
    assert torch.equal(case.raw, before)
    zeroer.zero_block_ids(ids)  # no sync: the kernel skips the three bad ids
    assert torch.equal(case.raw, case.expected_after(before, [1]))
    with pytest.raises(ValueError, match="integer"):
        zeroer.zero_block_ids(ids.float())


def test_packed_kernel_views_on_gpu():
    num_blocks, group, manager, kernel_views = _packed_case("cuda")
    zeroer = KVBlockZeroer("cuda", [group], [16], kernel_views, num_blocks)
    raw = raw_bytes(manager["a"])
    before = fill_random(raw, 3)
    zeroer.zero_block_ids([0, 4])
    assert torch.equal(raw, expected_after(before, {k: (v, 1) for k, v in manager.items()}, [0, 4]))


def test_cuda_graph_replays_new_ids_from_the_persistent_buffer():
    case = Case(random.Random(5), "cuda", max_blocks=12)
    zeroer = case.zeroer("triton", "cuda")
    zeroer.warmup(0)
    buf = zeroer.block_id_buffer(3)
    buf[:3].fill_(0)
    graph = torch.cuda.CUDAGraph()
    before = fill_random(case.raw, 6)
    with torch.cuda.graph(graph):
        zeroer.zero_block_ids(buf[:3])
    torch.cuda.synchronize()
    assert torch.equal(case.raw, before)  # capture runs nothing
    n = case.num_blocks
    for step, ids in enumerate(([1, 1, n - 1], [0, 2, n - 2], [n - 1, n - 1, n - 1])):
        before = fill_random(case.raw, 100 + step)
        buf[:3].copy_(torch.tensor(ids))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(case.raw, case.expected_after(before, ids)), f"replay {step}"
    assert zeroer.block_id_buffer(3).data_ptr() == buf.data_ptr()


def test_large_pages_use_wide_stores_and_stay_exact():
    spec = FullAttentionSpec(16, 8, 128, torch.bfloat16)
    layers, num_blocks = [f"l{i}" for i in range(4)], 64
    for layout in ("LBNHC", "BLNHC", "LHBNC"):
        s = compute_layout_strides(spec, num_blocks, len(layers), layout)
        tensor = KVCacheTensor(len(layers) * num_blocks * spec.page_size_bytes, layers, s[0], s[1])
        config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(layers, spec)], layout)
        kv = allocate_kv_cache(config, "cuda")
        zeroer = KVBlockZeroer("cuda", [AttentionGroup(_Backend, layers, spec, 0)], [16], kv, num_blocks)
        assert zeroer._allocations[0].vec_bytes == 16
        raw = raw_bytes(kv["l0"])
        before = fill_random(raw, 8)
        ids = list(range(1, num_blocks, 3))
        zeroer.zero_block_ids(ids)
        assert torch.equal(raw, expected_after(before, {k: (v, 1) for k, v in kv.items()}, ids)), layout


def test_staged_host_lists_keep_their_ids_while_the_device_lags():
    """The host runs a whole staging buffer ahead of a sleeping device: every launch still reads its own ids."""
    case = Case(random.Random(7), "cuda", max_blocks=40)
    zeroer = case.zeroer("triton", "cuda")
    rng = random.Random(3)
    calls = [[rng.randrange(case.num_blocks) for _ in range(rng.choice([1, 2, 70, 700]))] for _ in range(300)]
    before = fill_random(case.raw, 21)
    snapshots = torch.empty(len(calls), case.raw.numel(), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # NOTE: the device sleeps while the host stages every call
    for k, ids in enumerate(calls):
        zeroer.zero_block_ids(ids)
        snapshots[k].copy_(case.raw)
    torch.cuda.synchronize()
    done: list[int] = []
    for k, ids in enumerate(calls):
        done.extend(ids)
        if k % 37 == 0 or k == len(calls) - 1:
            assert torch.equal(snapshots[k], case.expected_after(before, done)), f"call {k}"


def test_host_lists_on_two_streams_and_longer_than_a_staging_part():
    case = Case(random.Random(8), "cuda", max_blocks=40)
    zeroer = case.zeroer("triton", "cuda")
    before = fill_random(case.raw, 22)
    side = torch.cuda.Stream()
    zeroer.zero_block_ids([1] * 70)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        zeroer.zero_block_ids([2, 3] * 40)
    torch.cuda.current_stream().wait_stream(side)
    many = [4] * (zeroer._id_buffer.part_ids + 5)  # past a part: the buffers grow, once
    zeroer.zero_block_ids(many)
    pinned = zeroer._id_buffer.pinned.data_ptr()
    zeroer.zero_block_ids([5] * len(many))
    assert zeroer._id_buffer.pinned.data_ptr() == pinned, "a later call of the same length allocated again"
    torch.cuda.synchronize()
    assert torch.equal(case.raw, case.expected_after(before, [1, 2, 3, 4, 5]))


def test_host_ids_are_refused_inside_graph_capture():
    case = Case(random.Random(9), "cuda", max_blocks=12)
    zeroer = case.zeroer("triton", "cuda")
    zeroer.warmup(0)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="block_id_buffer"):
        with torch.cuda.graph(graph):
            zeroer.zero_block_ids([1])


def test_from_views_on_gpu_matches_the_seed_constructor():
    for seed, case in _cases(10):
        a = case.zeroer("triton", "cuda", from_views=True)
        b = case.zeroer("triton", "cuda")
        assert a.segments == b.segments, f"seed {seed}"
        ids = list(range(0, case.num_blocks, 2))
        before = fill_random(case.raw, seed)
        a.zero_block_ids(ids)
        torch.cuda.synchronize()
        assert torch.equal(case.raw, case.expected_after(before, ids)), f"seed {seed}"
