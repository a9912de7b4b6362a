"""``kvcore bench plan``: time ``plan_kv_cache`` on a large hybrid model (target < 20 ms).

The model mixes full attention, sliding-window attention with half the page
(its block size doubles), and Mamba state caches with a smaller page (padded),
so every step of the planner runs: unification, grouping and one tensor per group.
"""

import argparse
import os
import statistics
import sys
import textwrap
from contextlib import contextmanager

import torch

from kvcore._table import terminal_width
from kvcore.memory.planner import plan_kv_cache
from kvcore.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvcore_bench import emit, machine, table
from kvcore_bench._timing import Timer
from kvcore_bench.options import ARGUMENTS

add_arguments = ARGUMENTS["plan"]
TARGET_MS = 20.0


def hybrid_model_specs(num_layers: int = 200) -> dict[str, KVCacheSpec]:
    """Layer specs of a hybrid model: per 4 layers, 2 sliding, 1 Mamba, 1 full."""
    full = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(
        16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, sliding_window=4096
    )
    mamba = MambaSpec(16, shapes=[(3, 2048), (1600, 16)], dtypes=[torch.bfloat16] * 2)
    cycle = [("self_attn", sliding), ("mixer", mamba), ("self_attn", sliding), ("self_attn", full)]
    return {
        f"model.layers.{i}.{cycle[i % 4][0]}": cycle[i % 4][1] for i in range(num_layers)
    }


@contextmanager
def _one_core():
    """Pin this process to one CPU core while timing (where the OS allows it)."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if before is not None:
            os.sched_setaffinity(0, {min(before)})
    except OSError:  # NOTE: some sandboxes forbid pinning; time unpinned then
        before = None
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def measure(args: argparse.Namespace) -> dict:
    """Time every layout; the result is what ``--json`` prints."""
    specs = hybrid_model_specs(args.layers)
    timer = Timer(torch.device("cpu"), args.repeat, warmup=0)
    rows = []
    with _one_core():
        for layout in args.layouts:
            try:
                config = plan_kv_cache(specs, layout, available_memory=args.memory)  # warm-up
            except ValueError as exc:
                # NOTE: e.g. LHBNC cannot overlay groups with different head counts.
                rows.append({"layout": layout.name, "refused": str(exc)})
                continue
            times = [t / 1e3 for t in timer.samples_us(
                lambda: plan_kv_cache(specs, layout, available_memory=args.memory))]
            rows.append({
                "layout": layout.name, "groups": len(config.kv_cache_groups),
                "num_blocks": config.num_blocks, "median_ms": statistics.median(times),
                "min_ms": min(times), "met": statistics.median(times) < TARGET_MS,
            })  # fmt: skip
    return {"machine": machine(torch.device("cpu")), "layers": args.layers, "memory": args.memory,
            "target_ms": TARGET_MS, "rows": rows}


def _print(result: dict) -> None:
    print(table(f"plan_kv_cache, {result['layers']}-layer hybrid model, one core of {result['machine']}", [
        ("layout", "layout", ""), ("groups", "groups", "d"), ("blocks", "num_blocks", ","),
        ("median ms", "median_ms", ".2f"), ("min ms", "min_ms", ".2f"),
        (f"< {TARGET_MS:g} ms", lambda r: "yes" if r["met"] else "NO", ""),
    ], [r for r in result["rows"] if "refused" not in r]))
    for r in result["rows"]:
        if "refused" in r:
            print(textwrap.fill(f"{r['layout']} refused: {r['refused']}", terminal_width(),
                                subsequent_indent="  "))


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every timed layout meets the target; 1 when one misses it or none can plan."""
    result = measure(args)
    emit(args, result, _print)
    timed = [r for r in result["rows"] if "refused" not in r]
    if not timed:
        print("kvcore bench plan: every layout refused the model; nothing was timed",
              file=sys.stderr)
        return 1
    return 0 if all(r["met"] for r in timed) else 1
