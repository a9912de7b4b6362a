"""``kvcore bench transfer --descriptors``: NIXL descriptors per transfer, and the time to build them.

For each layout, the descriptor list :class:`~kvcore.transfer.NixlAgent` hands
NIXL for ``N`` blocks (one ``[address, length, device]`` row per paired run of
``plan_transfer``'s fewest runs, per side) is built the way the agent builds
it: paired plan, rows, NIXL's ``Nx3`` array and, where NIXL imports, NIXL's
own ``nixlXferDList``. Blocks are scattered (odd ids: no two adjacent, the
worst case) or consecutive (the best). Counts depend on the layout, layers and
heads only, so the cache is allocated with a head size of 1 (small enough for
a CPU); NIXL 1.5's Python API takes ``Nx3`` rows only (no strided form).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvcore._table import Column, render
from kvcore.transfer import KVCacheDescriptor, describe
from kvcore.transfer.host_pool import whole_block_patterns
from kvcore.transfer.nixl_api import NixlUnavailableError, descriptor_rows, nixl_api, xfer_array
from kvcore.transfer.pairs import pair_runs


def _nixl_lists() -> Any:
    """A function turning an ``Nx3`` array into NIXL's descriptor list, or None without NIXL."""
    try:
        agent_cls, config_cls = nixl_api()
        agent = agent_cls("kvcore-descriptor-bench", config_cls(backends=[]))
    except (NixlUnavailableError, Exception):  # NOTE: NIXL may be absent or unable to start here
        return None
    return lambda array: agent.get_xfer_descs(array, "DRAM")


def _build(desc: KVCacheDescriptor, ids: torch.Tensor, to_nixl: Any) -> int:
    """Build both sides' descriptor lists as ``NixlAgent`` does (descriptor described once, as there)."""
    groups = tuple(g.group_id for g in desc.groups if g.layers)
    patterns = whole_block_patterns(desc, groups)
    plan = pair_runs(patterns, ids, patterns, ids)
    base = desc.allocations[0].base_ptr
    local = xfer_array([descriptor_rows(base, p.src_offsets, p.lengths, 0) for p in plan])
    remote = xfer_array([descriptor_rows(base, p.dst_offsets, p.lengths, 0) for p in plan])
    if to_nixl is not None:
        to_nixl(local)
        to_nixl(remote)
    return len(local)


def descriptor_rows_of(args: argparse.Namespace, make: Any, repeats: int = 5) -> list[dict[str, Any]]:
    """One row per layout: descriptors and build time for ``args.descriptors`` blocks."""
    n = args.descriptors
    to_nixl = _nixl_lists()
    rows = []
    for layout in args.layouts:
        kv = make(layout.name, 2 * n + 1)
        desc = describe(kv)
        for kind, ids in (("scattered", torch.arange(n) * 2 + 1), ("consecutive", torch.arange(n) + 1)):
            count = _build(desc, ids, to_nixl)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                _build(desc, ids, to_nixl)
                times.append(time.perf_counter() - start)
            rows.append({"layout": layout.name, "blocks": n, "ids": kind, "descriptors": count,
                         "per_block": count / n, "build_ms": statistics.median(times) * 1e3,
                         "nixl_dlist": to_nixl is not None})
        del kv
    return rows


def print_descriptor_rows(rows: list[dict[str, Any]], model: dict[str, Any], width: int) -> None:
    columns = [Column("layout"), Column("blocks", right=True), Column("ids"), Column("descriptors", right=True),
               Column("per block", right=True), Column("build ms", right=True)]
    nixl = "and NIXL's nixlXferDList " if rows and rows[0]["nixl_dlist"] else ""
    title = (f"NIXL descriptors per side of one transfer ({model['layers']} layers, {model['kv_heads']} KV heads); "
             f"build: plan, rows, Nx3 array {nixl}for both sides, median")
    print(render(columns, [[r["layout"], r["blocks"], r["ids"], r["descriptors"], f"{r['per_block']:.3g}",
                            f"{r['build_ms']:.2f}"] for r in rows], title=title, width=width))
