"""``kvcore bench transfer --descriptors``: NIXL descriptors per transfer, and their build time.

For each layout, the descriptor lists :class:`~kvcore.transfer.NixlAgent` hands NIXL for
``N`` blocks are built as the agent builds them (paired plan, ``Nx3`` arrays and, where
NIXL imports, NIXL's ``nixlXferDList``), for scattered (odd: the worst case) and
consecutive (the best) ids. Counts depend on layout, layers and heads only, so the cache
has a head size of 1. NIXL 1.5's Python API takes ``Nx3`` rows only (no strided form).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvcore._table import Column, render
from kvcore.transfer import KVCacheDescriptor, describe
from kvcore.transfer.nixl_api import nixl_api, xfer_arrays
from kvcore.transfer.pairs import pair_runs
from kvcore.transfer.plan import group_selection, whole_block_patterns


def _nixl_lists() -> Any:
    """A function turning an ``Nx3`` array into NIXL's descriptor list, or None without NIXL."""
    try:
        agent_cls, config_cls = nixl_api()
        agent = agent_cls("kvcore-descriptor-bench", config_cls(backends=[]))
    except Exception:  # NOTE: NIXL may be absent (NixlUnavailableError) or unable to start here
        return None
    return lambda array: agent.get_xfer_descs(array, "DRAM")


def _build(desc: KVCacheDescriptor, ids: torch.Tensor, to_nixl: Any) -> int:
    """Build both sides' descriptor lists as ``NixlAgent`` does (the peer: this cache)."""
    patterns = whole_block_patterns(desc, group_selection(desc, None))
    arrays = xfer_arrays(pair_runs(patterns, ids, patterns, ids), desc, desc)
    if to_nixl is not None:
        for array in arrays:
            to_nixl(array)
    return len(arrays[0])


def descriptor_rows_of(args: argparse.Namespace, make: Any, repeats: int = 5) -> list[dict]:
    """One row per layout and id kind: descriptors and build time for ``args.descriptors`` ids."""
    n = args.descriptors
    id_kinds = (("scattered", torch.arange(n) * 2 + 1), ("consecutive", torch.arange(n) + 1))
    to_nixl = _nixl_lists()
    rows = []
    for layout in args.layouts:
        desc = describe(make(layout.name, 2 * n + 1))
        for kind, ids in id_kinds:
            count = _build(desc, ids, to_nixl)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                _build(desc, ids, to_nixl)
                times.append(time.perf_counter() - start)
            rows.append({"layout": layout.name, "blocks": n, "ids": kind, "descriptors": count,
                         "per_block": count / n, "build_ms": statistics.median(times) * 1e3,
                         "nixl_dlist": to_nixl is not None})
    return rows


def print_descriptor_rows(rows: list[dict[str, Any]], model: dict[str, Any], width: int) -> None:
    columns = [Column("layout"), Column("blocks", right=True), Column("ids"),
               Column("descriptors", right=True), Column("per block", right=True),
               Column("build ms", right=True)]
    nixl = "and NIXL's nixlXferDList " if rows and rows[0]["nixl_dlist"] else ""
    title = (f"NIXL descriptors per side of one transfer ({model['layers']} layers, "
             f"{model['kv_heads']} KV heads); build: plan, rows, Nx3 array {nixl}for both sides, "
             "median")
    print(render(columns, [[r["layout"], r["blocks"], r["ids"], r["descriptors"],
                            f"{r['per_block']:.3g}", f"{r['build_ms']:.2f}"] for r in rows],
                 title=title, width=width))
