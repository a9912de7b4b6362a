"""Tensor parallelism: head sharding rules and cross-rank agreement over gloo.

Invariants:
- the KV heads of all ranks partition the model's heads when the rank count divides them;
- with fewer heads than ranks, each rank holds exactly the head its query heads read;
- sharded pages add up to the unsharded page (divisible heads);
- every rank of a group gets the same block count (the minimum) and the same layout,
  or every rank gets the same clear error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.distributed import agree_layout, agree_num_blocks, kv_head_range, shard_spec
from kvcore.memory.layout import KVCacheLayout
from kvcore.specs import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_dist_workers.py")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


def _resolve(lists, requested=None):
    from kvcore.plugins.layouts import resolve_kv_cache_layout

    return resolve_kv_cache_layout(lists, (), requested)


# ---- head ranges and spec sharding (no process group) ---------------------------------


@settings(max_examples=50, deadline=None)
@given(per_rank=st.integers(1, 8), tp_size=st.sampled_from([1, 2, 3, 4, 8]))
def test_divisible_heads_partition_in_order(per_rank, tp_size):
    num_kv_heads = per_rank * tp_size
    held = [h for r in range(tp_size) for h in kv_head_range(num_kv_heads, r, tp_size)]
    assert held == list(range(num_kv_heads))


@settings(max_examples=50, deadline=None)
@given(
    num_kv_heads=st.sampled_from([1, 2, 4]),
    factor=st.sampled_from([2, 4]),
    group_size=st.integers(1, 4),
)
def test_replicated_head_is_the_one_its_query_heads_read(num_kv_heads, factor, group_size):
    tp_size = num_kv_heads * factor
    num_q_heads = tp_size * group_size  # query heads always split evenly
    per_rank_q = num_q_heads // tp_size
    q_per_kv = num_q_heads // num_kv_heads
    for rank in range(tp_size):
        heads = kv_head_range(num_kv_heads, rank, tp_size)
        assert len(heads) == 1
        read = {q // q_per_kv for q in range(rank * per_rank_q, (rank + 1) * per_rank_q)}
        assert read == set(heads)
    # every head is served by some rank, each by `factor` ranks
    served = [kv_head_range(num_kv_heads, r, tp_size)[0] for r in range(tp_size)]
    assert sorted(served) == sorted(list(range(num_kv_heads)) * factor)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 8, 16, 32]),
    per_rank=st.integers(1, 4),
    tp_size=st.sampled_from([2, 4, 8]),
    head_size=st.sampled_from([16, 64, 128]),
    head_size_v=st.sampled_from([None, 0, 32]),
    dtype=st.sampled_from(DTYPES),
    sliding=st.booleans(),
)
def test_sharded_pages_add_up(block_size, per_rank, tp_size, head_size, head_size_v, dtype, sliding):
    num_kv_heads = per_rank * tp_size
    kwargs = dict(head_size_v=head_size_v)
    if sliding:
        spec = SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype, sliding_window=64, **kwargs)
    else:
        spec = FullAttentionSpec(block_size, num_kv_heads, head_size, dtype, **kwargs)
    shards = [shard_spec(spec, r, tp_size) for r in range(tp_size)]
    assert sum(s.page_size_bytes for s in shards) == spec.page_size_bytes
    for s in shards:
        assert type(s) is type(spec)
        assert s.num_kv_heads == per_rank
        assert (s.block_size, s.head_size, s.head_size_v, s.dtype) == (
            spec.block_size, spec.head_size, spec.head_size_v, spec.dtype)
        if sliding:
            assert s.sliding_window == 64


def test_replicated_spec_holds_one_head():
    spec = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    for rank in range(8):
        s = shard_spec(spec, rank, 8)
        assert s.num_kv_heads == 1
        assert s.page_size_bytes * 2 == spec.page_size_bytes


def test_head_slots_shard_like_heads():
    spec = FullAttentionSpec(16, 6, 64, torch.float16, num_head_slots=8)
    s = shard_spec(spec, 1, 2)
    assert (s.num_kv_heads, s.num_head_slots, s.num_heads) == (3, 4, 4)
    assert 2 * s.page_size_bytes == spec.page_size_bytes
    with pytest.raises(ValueError, match="num_head_slots=6"):
        shard_spec(FullAttentionSpec(16, 4, 64, torch.float16, num_head_slots=6), 0, 4)


def test_padded_page_scales_when_exact_else_dropped():
    spec = FullAttentionSpec(16, 4, 64, torch.float16)
    exact = FullAttentionSpec(16, 4, 64, torch.float16, page_size_padded=spec.page_size_bytes + 512)
    s = shard_spec(exact, 0, 4)
    assert s.page_size_padded == exact.page_size_padded // 4
    assert 4 * s.page_size_bytes == exact.page_size_bytes
    odd = FullAttentionSpec(16, 4, 64, torch.float16, page_size_padded=spec.page_size_bytes + 2)
    s = shard_spec(odd, 3, 4)
    assert s.page_size_padded is None
    assert s.page_size_bytes == spec.page_size_bytes // 4


def test_mla_and_state_caches_are_left_whole():
    mla = MLAAttentionSpec(16, 1, 576, torch.bfloat16)
    mamba = MambaSpec(16, [(4, 128), (8, 64, 16)], [torch.float32, torch.bfloat16])
    for rank in range(4):
        assert shard_spec(mla, rank, 4) == mla
        assert shard_spec(mamba, rank, 4) == mamba
    spec = FullAttentionSpec(16, 8, 64, torch.float16)
    assert shard_spec(spec, 0, 1) is spec


def test_uniform_type_specs_shard_each_layer():
    group = UniformTypeKVCacheSpecs(
        16,
        {"a": FullAttentionSpec(16, 8, 64, torch.float16), "b": FullAttentionSpec(16, 4, 128, torch.float16)},
    )
    s = shard_spec(group, 1, 4)
    assert [x.num_kv_heads for x in s.kv_cache_specs.values()] == [2, 1]
    assert 4 * s.page_size_bytes == group.page_size_bytes


@pytest.mark.parametrize(
    ("rank", "size", "error", "match"),
    [
        (2, 2, ValueError, "tp_rank=2 is out of range for tp_size=2"),
        (-1, 4, ValueError, "tp_rank=-1"),
        (0, 0, ValueError, "tp_size must be a positive integer, got 0"),
        (True, 2, TypeError, "tp_rank"),
        (0, 2.0, TypeError, "tp_size"),
    ],
)
def test_bad_rank_or_size(rank, size, error, match):
    spec = FullAttentionSpec(16, 8, 64, torch.float16)
    with pytest.raises(error, match=match):
        shard_spec(spec, rank, size)
    with pytest.raises(error, match=match):
        kv_head_range(8, rank, size)


def test_indivisible_heads_name_both_numbers():
    spec = FullAttentionSpec(16, 6, 64, torch.float16)
    with pytest.raises(ValueError, match=r"num_kv_heads=6 .*tp_size=4"):
        shard_spec(spec, 0, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 .*tp_size=2"):
        kv_head_range(3, 1, 2)
    with pytest.raises(TypeError, match="KVCacheSpec"):
        shard_spec("spec", 0, 2)


def test_without_process_group_agreement_is_local():
    assert not torch.distributed.is_initialized()
    budget = random.Random(7).randint(2, 10_000)
    assert agree_num_blocks(budget) == budget
    with pytest.raises(ValueError, match="num_blocks"):
        agree_num_blocks(0)
    local = [KVCacheLayout.BLNHC, KVCacheLayout.LBNHC]
    assert agree_layout(local) == _resolve([local])
    with pytest.raises(TypeError, match="list"):
        agree_layout("LBNHC")


# ---- two gloo ranks on CPU -------------------------------------------------------------


def run_ranks(plan: dict, world: int = 2, timeout: float = 120.0) -> list[dict]:
    """Run ``plan`` on ``world`` gloo ranks (separate processes); one result dict per rank."""
    env = {k: v for k, v in os.environ.items() if k != "KVCORE_KV_CACHE_LAYOUT"}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp, "plan.json")
        plan_path.write_text(json.dumps(plan))
        outs = [Path(tmp, f"out{r}.json") for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(r), str(world), str(Path(tmp, "init")),
                 str(plan_path), str(outs[r])],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(world)
        ]
        try:
            logs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, (p, log) in enumerate(zip(procs, logs)):
            assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log}"
        return [json.loads(o.read_text()) for o in outs]


_RNG = random.Random(20261107)
BUDGETS = [_RNG.randint(2, 100_000) for _ in range(2)]
SUB_BUDGETS = [_RNG.randint(2, 100_000) for _ in range(2)]
COMPATIBLE = [["BLNHC", "LBNHC", "LBHNC"], ["LBHNC", "LHBNC", "LBNHC"]]
DISJOINT = [["LBNHC", "LBHNC"], ["BLNHC", "BHLNC"]]
PLAN = {
    "blocks": {"kind": "blocks", "budgets": BUDGETS},
    "blocks_subgroup": {"kind": "blocks", "budgets": SUB_BUDGETS, "subgroup": True},
    "compatible": {"kind": "layout", "supported": COMPATIBLE},
    "requested": {"kind": "layout", "supported": COMPATIBLE, "requested": ["LBHNC", "LBHNC"]},
    "disjoint": {"kind": "layout", "supported": DISJOINT},
    "split_request": {"kind": "layout", "supported": COMPATIBLE, "requested": ["LBNHC", "LBHNC"]},
    "any_layout": {"kind": "layout", "supported": [None, ["BLNHC", "LBHNC"]]},
    "bad_name": {"kind": "layout", "supported": [["LBNHC"], ["nope"]]},
    "blocks_after_errors": {"kind": "blocks", "budgets": BUDGETS[::-1]},
}


@pytest.fixture(scope="module")
def gloo_results() -> list[dict]:
    return run_ranks(PLAN)


def test_ranks_agree_on_the_smallest_budget(gloo_results):
    assert [r["blocks"]["value"] for r in gloo_results] == [min(BUDGETS)] * 2
    assert [r["blocks_subgroup"]["value"] for r in gloo_results] == [min(SUB_BUDGETS)] * 2
    # the group still works after ranks raised in agree_layout
    assert [r["blocks_after_errors"]["value"] for r in gloo_results] == [min(BUDGETS)] * 2


def test_compatible_lists_resolve_to_one_layout(gloo_results):
    expected = _resolve([[KVCacheLayout[n] for n in names] for names in COMPATIBLE])
    assert [r["compatible"]["value"] for r in gloo_results] == [expected.name] * 2
    assert all(expected.name in names for names in COMPATIBLE)
    assert [r["requested"]["value"] for r in gloo_results] == ["LBHNC"] * 2
    any_first = _resolve([None, [KVCacheLayout.BLNHC, KVCacheLayout.LBHNC]])
    assert any_first in (KVCacheLayout.BLNHC, KVCacheLayout.LBHNC)
    assert [r["any_layout"]["value"] for r in gloo_results] == [any_first.name] * 2


def test_disjoint_lists_fail_on_every_rank(gloo_results):
    messages = [r["disjoint"] for r in gloo_results]
    assert all(m.get("type") == "ValueError" for m in messages), messages
    assert messages[0]["error"] == messages[1]["error"]
    text = messages[0]["error"]
    assert "rank 0 supports [LBNHC, LBHNC]" in text
    assert "rank 1 supports [BLNHC, BHLNC]" in text


def test_different_requests_fail_on_every_rank(gloo_results):
    for r in gloo_results:
        assert r["split_request"].get("type") == "ValueError", r["split_request"]
        assert "rank 0 -> LBNHC" in r["split_request"]["error"]
        assert "rank 1 -> LBHNC" in r["split_request"]["error"]


def test_one_rank_bad_input_fails_every_rank(gloo_results):
    for r in gloo_results:
        assert r["bad_name"].get("type") == "ValueError", r["bad_name"]
        assert "rank 1" in r["bad_name"]["error"] and "'nope'" in r["bad_name"]["error"]


# ---- the TP decode example -------------------------------------------------------------


def test_tp_decode_example_matches_single_process():
    """Two gloo ranks at tiny size (~10 s on 2 cores): logits match one process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "tp_decode.py"), "--tiny"]
    env = {k: v for k, v in os.environ.items() if k != "KVCORE_KV_CACHE_LAYOUT"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    found = re.search(r"max abs error vs single process: (\S+) \(tolerance (\S+)\)", proc.stdout)
    assert found, log
    assert float(found.group(1)) <= float(found.group(2)), found.group(0)
    assert "generated tokens equal: True" in proc.stdout
    assert proc.stdout.count("planned 40; layout") == 2, log


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_tp_decode_example_on_two_gpus_nccl():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "tp_decode.py"), "--device", "cuda"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(nccl," in proc.stdout and "OK:" in proc.stdout, proc.stdout


def _tp_decode_module():
    spec = importlib.util.spec_from_file_location("tp_decode_example", ROOT / "examples" / "tp_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp_decode_uses_cuda_only_with_one_gpu_per_rank(monkeypatch, capsys):
    """Two ranks on a one-GPU machine: CPU and gloo by default, a usage error for --device cuda."""
    tp = _tp_decode_module()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = tp.parse_args(["--tiny"])
    assert (args.device, args.backend) == ("cpu", "torch")
    with pytest.raises(SystemExit) as exc:
        tp.parse_args(["--device", "cuda"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "needs one GPU per rank: 2 ranks on this host but 1 CUDA device" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = tp.parse_args([])
    assert (args.device, args.backend) == ("cuda", "triton")
    assert tp.parse_args(["--backend", "torch"]).backend == "torch"
