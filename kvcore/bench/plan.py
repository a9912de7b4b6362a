"""``kvcore bench plan``: time ``plan_kv_cache`` on a large hybrid model (target < 20 ms).

The model mixes full attention, sliding-window attention with half the page
(its block size doubles), and Mamba state caches with a smaller page (padded),
so every step of the planner runs: unification, grouping and one tensor per group.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager

import torch

from kvcore.cli._args import layout_arg
from kvcore.cli.plan import parse_memory
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

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
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
    except OSError:  # NOTE: some sandboxes forbid pinning; time unpinned then
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=200, help="layers of the model (default 200)")
    parser.add_argument("--repeat", type=int, default=100, help="timed plans per layout (default 100)")
    parser.add_argument("--memory", default=80 << 30, type=parse_memory, help="budget, e.g. 80GiB (the default)")
    parser.add_argument(
        "--layout", action="append", type=layout_arg,
        help="layout to time (repeatable; default: every layout)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    specs = hybrid_model_specs(args.layers)
    layouts = args.layout or list(KVCacheLayout)
    table = Table(title=f"plan_kv_cache, {args.layers}-layer hybrid model, one core")
    for column in ("layout", "groups", "blocks", "median ms", "min ms", f"< {TARGET_MS:g} ms"):
        table.add_column(column, justify="right")
    worst = 0.0
    with _one_core():
        for layout in layouts:
            try:
                config = plan_kv_cache(specs, layout, available_memory=args.memory)  # warm-up
            except ValueError as exc:
                # NOTE: e.g. LHBNC cannot overlay groups with different head counts.
                table.add_row(layout.name, "-", "-", "-", "-", f"refused: {str(exc)[:60]}")
                continue
            times = []
            for _ in range(max(1, args.repeat)):
                start = time.perf_counter()
                plan_kv_cache(specs, layout, available_memory=args.memory)
                times.append((time.perf_counter() - start) * 1e3)
            median = statistics.median(times)
            worst = max(worst, median)
            table.add_row(
                layout.name, str(len(config.kv_cache_groups)), f"{config.num_blocks:,}",
                f"{median:.2f}", f"{min(times):.2f}", "yes" if median < TARGET_MS else "NO",
            )  # fmt: skip
    Console().print(table)
    return 0 if worst < TARGET_MS else 1
