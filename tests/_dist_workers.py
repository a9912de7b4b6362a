"""One rank of a gloo group, spawned by tests/test_distributed.py.

Usage: python tests/_dist_workers.py RANK WORLD INIT_FILE PLAN_JSON OUT_JSON

Joins a CPU (gloo) process group through ``file://INIT_FILE``, runs every case
of the plan in order and writes, per case, ``{"value": ...}`` or
``{"error": message, "type": exception name}`` to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

from kvcore.distributed import agree_layout, agree_num_blocks


def _run_case(case: dict, rank: int) -> object:
    group = dist.new_group(backend="gloo") if case.get("subgroup") else None
    if case["kind"] == "blocks":
        return agree_num_blocks(case["budgets"][rank], group=group)
    if case["kind"] == "layout":
        requested = case.get("requested")
        layout = agree_layout(
            case["supported"][rank],
            group=group,
            requested=None if requested is None else requested[rank],
        )
        return layout.name
    raise ValueError(f"unknown case kind {case['kind']!r}")


def main(argv: list[str]) -> int:
    rank, world = int(argv[1]), int(argv[2])
    init_file, plan_path, out_path = argv[3], argv[4], argv[5]
    with open(plan_path) as f:
        plan = json.load(f)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    results: dict[str, dict] = {}
    try:
        for name, case in plan.items():
            try:
                results[name] = {"value": _run_case(case, rank)}
            except (TypeError, ValueError) as err:
                results[name] = {"error": str(err), "type": type(err).__name__}
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
