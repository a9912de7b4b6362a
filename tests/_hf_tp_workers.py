"""One rank of a two-process gloo group serving an HF model with tensor parallelism.

Spawned by tests/test_hf_tp.py. Usage:
    python tests/_hf_tp_workers.py RANK WORLD INIT_FILE PLAN_JSON OUT_JSON

Joins a CPU (gloo) group through ``file://INIT_FILE``, runs every case of the
plan in order and writes, per case, ``{"value": ...}`` or ``{"error": message,
"type": exception name}`` to OUT_JSON. Every rank builds the same small
random-weight model (``kvcore.hf.models``, one seed); transformers shards it with
its own tensor-parallel plan and ``kvcore.hf.Engine(..., group=WORLD)`` serves it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers

from kvcore.hf import Engine
from kvcore.hf.models import model_config, random_model
from kvcore.hf.tp import load_tp_model, resolve_tp, shard_model, tp_group_size


def tiny(arch: str, seed: int, **overrides):
    """kvcore.hf.models' small random-weight model of ``arch`` (hidden 64, 2 layers, 4 query / 2 KV heads of 16)."""
    return random_model(model_config(arch, **overrides), seed=seed)


#: Prompt lengths: one block or less up to three blocks of 16 tokens.
PROMPT_LENS = [5, 40, 17, 33, 9]


def prompts(seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = PROMPT_LENS
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, ps: list[list[int]], n: int) -> tuple[list, float]:
    """``model.generate`` on each prompt alone, and the smallest top-1/top-2 logit margin seen."""
    out, margin = [], float("inf")
    for p in ps:
        res = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        out.append(res.sequences[0, len(p):].tolist())
        for scores in res.scores:
            top = scores[0].float().topk(2).values
            margin = min(margin, float(top[0] - top[1]))
    return out, margin


def _engine(model, group, case: dict, rank: int) -> Engine:
    budget = case.get("available_memory")
    kwargs = dict(backend=case.get("backend", "torch"), block_size=case.get("block_size", 16),
                  max_num_seqs=case.get("max_num_seqs", 2), max_num_batched_tokens=case.get("budget", 32),
                  group=group)
    if budget is not None:
        kwargs["available_memory"] = budget[rank]
    else:
        kwargs["num_blocks"] = case["num_blocks"]
    return Engine(model, **kwargs)


def _serve(case: dict, rank: int, world: int) -> object:
    full = tiny(case.get("arch", "llama"), case["seed"])
    ps = prompts(case["seed"] + 1, full.config.vocab_size)
    n = case["max_new_tokens"]
    group = dist.group.WORLD
    if case.get("from_dir"):
        if rank == 0:
            full.save_pretrained(case["from_dir"])
        dist.barrier()
        tp_model = load_tp_model(case["from_dir"], group=group, dtype=torch.float32)
    else:
        tp_model = shard_model(full, group)
    local = tp_model.model.layers[0].self_attn.k_proj.weight
    local = local.to_local() if hasattr(local, "to_local") else local
    engine = _engine(tp_model, group, case, rank)
    tokens = engine.generate(ps, n)
    result = {
        "transformers": transformers.__version__,
        "tp": resolve_tp(tp_model, group),
        "local_kv_rows": int(local.shape[0]),
        "num_blocks": engine.kv.num_blocks,
        "num_groups": engine.kv.num_groups,
        "layout": engine.kv.layout.name,
        "kv_heads_in_cache": int(next(iter(engine.kv.layer_kv_caches.values())).shape[1]),
        "tokens": tokens,
        "stats": {k: v for k, v in engine.stats().items() if not k.endswith("_s")},
    }
    if rank == 0:
        single = _engine(full, None, {**case, "available_memory": None,
                                      "num_blocks": case.get("num_blocks", result["num_blocks"])}, 0)
        result["single"] = single.generate(ps, n)
        result["generate"], result["margin"] = _reference(full, ps, n)
    dist.barrier()
    return result


def _run_case(case: dict, rank: int, world: int) -> object:
    kind = case["kind"]
    if kind == "serve":
        return _serve(case, rank, world)
    if kind == "subgroup":
        sub = dist.new_group([0], backend="gloo")
        return list(tp_group_size(sub)) if rank == 0 else None
    if kind == "unsharded":
        return resolve_tp(tiny("llama", 0), dist.group.WORLD)
    if kind == "sharded_without_group":
        return resolve_tp(shard_model(tiny("llama", 0), dist.group.WORLD), None)
    if kind == "odd_heads":
        model = tiny("llama", 0, num_attention_heads=6, num_key_value_heads=3, hidden_size=96)
        return shard_model(model, dist.group.WORLD) is not None
    if kind == "different_weights":
        return shard_model(tiny("llama", rank), dist.group.WORLD) is not None
    raise ValueError(f"unknown case kind {kind!r}")


def main(argv: list[str]) -> int:
    rank, world = int(argv[1]), int(argv[2])
    init_file, plan_path, out_path = argv[3], argv[4], argv[5]
    with open(plan_path) as f:
        plan = json.load(f)
    # NOTE: what torchrun would set: transformers' tensor-parallel init reads LOCAL_RANK
    # (and binds that device); both ranks run on this host.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=90))
    results: dict[str, dict] = {}
    try:
        for name, case in plan.items():
            try:
                results[name] = {"value": _run_case(case, rank, world)}
            except (TypeError, ValueError) as err:
                results[name] = {"error": str(err), "type": type(err).__name__}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
