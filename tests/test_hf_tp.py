"""Tensor parallelism with an HF model: transformers' own TP plan for the weights, kvcore's shard_spec for the cache.

Two gloo processes on CPU serve a tiny random-weight Llama (4 query heads, 2 KV
heads, 2 layers) with ``kvcore.hf.Engine(..., group=WORLD)``; greedy tokens must
equal a one-process ``Engine`` and ``model.generate`` on each prompt alone, in
float32, with few enough blocks and sequences that requests wait and blocks
recycle. Single-process checks cover the helpers' refusals.

transformers loads tensor-parallel models only with ``accelerate`` installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvcore.distributed import shard_spec  # noqa: E402
from kvcore.hf.tp import (  # noqa: E402
    check_splittable,
    load_tp_model,
    resolve_tp,
    shard_model,
    tp_group_size,
)
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_hf_tp_workers.py")
HAS_ACCELERATE = bool(__import__("importlib").util.find_spec("accelerate"))


# ---- single process ---------------------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    kv_heads=st.integers(1, 8),
    group=st.integers(1, 4),
    tp_size=st.sampled_from([1, 2, 3, 4, 8]),
    sliding=st.booleans(),
)
def test_splittable_exactly_when_tp_divides_both_head_counts(kv_heads, group, tp_size, sliding):
    q_heads = kv_heads * group
    config = LlamaConfig(num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                         hidden_size=16 * q_heads)
    ok = q_heads % tp_size == 0 and kv_heads % tp_size == 0
    if not ok:
        with pytest.raises(ValueError, match=f"tp_size={tp_size} does not divide"):
            check_splittable(config, tp_size)
        return
    check_splittable(config, tp_size)
    spec = (SlidingWindowSpec(16, kv_heads, 16, torch.float32, sliding_window=32) if sliding
            else FullAttentionSpec(16, kv_heads, 16, torch.float32))
    specs = {"model.layers.0.self_attn": spec, "model.layers.1.self_attn": spec}
    per_rank = [{n: shard_spec(s, r, tp_size) for n, s in specs.items()} for r in range(tp_size)]
    for sharded in per_rank:
        assert list(sharded) == list(specs)
        for s in sharded.values():
            # every rank stores exactly the heads transformers' column split hands it
            assert s.num_kv_heads * tp_size == kv_heads
            assert s.page_size_bytes * tp_size == spec.page_size_bytes
            assert type(s) is type(spec)


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2)).eval()


def test_one_process_needs_no_sharding():
    model = _tiny()
    assert tp_group_size(None) == (0, 1)
    assert resolve_tp(model, None) == (0, 1)
    assert shard_model(model, None) is model


def test_bad_arguments_are_refused_clearly(tmp_path):
    with pytest.raises(TypeError, match="PreTrainedModel"):
        shard_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a directory"):
        load_tp_model(tmp_path / "missing")
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="not initialized"):
            tp_group_size(object())


@pytest.mark.skipif(not HAS_ACCELERATE, reason="transformers' TP loading needs accelerate")
@pytest.mark.parametrize("value", [None, "", "one"])
def test_a_missing_local_rank_is_named_before_transformers_reads_it(monkeypatch, value):
    """transformers' TP init reads LOCAL_RANK (5.17: a raw KeyError); kvcore names it and the remedy."""
    from kvcore.hf.tp import _distributed_config

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    if value is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", value)
    match = rf"LOCAL_RANK={value!r}: transformers' tensor-parallel loading.*torchrun sets it"
    with pytest.raises(ValueError, match=match):
        _distributed_config(config, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _distributed_config(config, 2).tp_size == 2


# ---- two gloo processes -----------------------------------------------------------------

#: One block of one rank: 2 layers x (K, V) x 1 KV head x 16 tokens x 16 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * 1 * 16 * 16 * 4
SERVE = {"kind": "serve", "seed": 3, "max_new_tokens": 8, "max_num_seqs": 2, "budget": 24}


def _run(plan: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan_path = tmp / "plan.json"
        for case in plan.values():
            if case.get("from_dir") is True:
                case["from_dir"] = str(tmp / "checkpoint")
        plan_path.write_text(json.dumps(plan))
        env = {k: v for k, v in os.environ.items() if k != "KVCORE_KV_CACHE_LAYOUT"}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        # NOTE: CPU ranks (gloo), also on a GPU machine: transformers would otherwise place each
        # rank's shard on the accelerator it detects (cuda:LOCAL_RANK), which may not exist.
        env["CUDA_VISIBLE_DEVICES"] = ""
        procs = [
            subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(tmp / "init"),
                              str(plan_path), str(tmp / f"out{r}.json")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)
        ]
        logs = [p.communicate(timeout=180)[0] for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-4000:]
        return [json.loads((tmp / f"out{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def served():
    if not HAS_ACCELERATE:
        pytest.skip("transformers' tensor-parallel loading needs accelerate (pip install accelerate)")
    plan = {
        # rank r offers a different memory budget: both must plan the smaller one
        "shard": {**SERVE, "available_memory": [7 * BLOCK_BYTES, 10 * BLOCK_BYTES]},
        "checkpoint": {**SERVE, "num_blocks": 6, "from_dir": True},
        # sliding and full layers: two KV cache groups, each with its own block tables
        "gemma3": {**SERVE, "arch": "gemma3", "num_blocks": 12},
        "subgroup": {"kind": "subgroup"},
        "unsharded": {"kind": "unsharded"},
        "sharded_without_group": {"kind": "sharded_without_group"},
        "odd_heads": {"kind": "odd_heads"},
        "different_weights": {"kind": "different_weights"},
    }
    return _run(plan)


@pytest.mark.parametrize("case", ["shard", "checkpoint", "gemma3"])
def test_tp2_tokens_equal_one_process_and_generate(served, case):
    r0, r1 = served[0][case], served[1][case]
    assert "value" in r0 and "value" in r1, (r0, r1)
    v0, v1 = r0["value"], r1["value"]
    assert v0["tp"] == [0, 2] and v1["tp"] == [1, 2]
    # transformers' plan gave each rank one of the 2 KV heads (16 rows of k_proj) and so did the cache
    assert v0["local_kv_rows"] == v1["local_kv_rows"] == 16
    assert v0["kv_heads_in_cache"] == v1["kv_heads_in_cache"] == 1
    assert v0["num_blocks"] == v1["num_blocks"] and v0["layout"] == v1["layout"]
    assert v0["margin"] > 1e-3, "greedy ties: the comparison would be luck"
    assert v0["tokens"] == v1["tokens"]
    assert v0["tokens"] == v0["single"]
    assert v0["tokens"] == v0["generate"]
    assert sum(map(len, v0["tokens"])) > 20
    # every rank ran the same schedule; so few blocks and sequences that blocks were recycled
    assert v0["stats"] == v1["stats"]
    assert v0["stats"]["blocks_allocated"] > v0["num_blocks"]
    assert v0["stats"]["requests_finished"] == 5
    assert v0["num_groups"] == v1["num_groups"] == (2 if case == "gemma3" else 1)
    if case == "gemma3":
        assert v0["stats"]["window_freed_blocks"] > 0


def test_ranks_agree_on_the_smaller_block_budget(served):
    v0, v1 = served[0]["shard"]["value"], served[1]["shard"]["value"]
    assert v0["num_blocks"] == v1["num_blocks"] == 7


def test_a_group_that_is_not_the_world_is_refused(served):
    r0 = served[0]["subgroup"]
    assert r0.get("type") == "ValueError", r0
    assert "ranks [0]" in r0["error"] and "dist.group.WORLD" in r0["error"]


@pytest.mark.parametrize("case, needle", [
    ("unsharded", "shard it first"),
    ("sharded_without_group", "pass group=dist.group.WORLD"),
    ("odd_heads", "tp_size=2 does not divide the model's 6 query heads and 3 KV heads"),
    ("different_weights", "different weights"),
])
def test_mismatches_are_refused_on_every_rank(served, case, needle):
    for rank in range(2):
        res = served[rank][case]
        assert res.get("type") == "ValueError", (rank, res)
        assert needle in res["error"], (rank, res["error"])
