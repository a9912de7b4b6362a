"""``kvcore bench transfer --descriptors``: what NIXL is handed for one transfer, and its cost.

For each layout and ``N`` scattered (odd: the worst case) or consecutive (the best) blocks:
the copies NIXL makes (runs adjacent on both sides merged); the Nx5 strided rows
:class:`~kvcore.transfer.NixlAgent` prepares once per side (one per run of a block pattern,
whatever ``N``); and the host time of one call, per call (a paired plan, ``Nx3`` arrays and,
where NIXL imports, NIXL's ``nixlXferDList``: the agent's former path) against prepared
(descriptor indices into both prepared lists: the agent's path now). Counts depend on layout,
layers and heads only, so the cache has a head size of 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from kvcore._table import Column, render
from kvcore.transfer import KVCacheDescriptor, describe
from kvcore.transfer.nixl_api import PreparedRuns, nixl_api, paired_indices, xfer_arrays
from kvcore.transfer.pairs import pair_runs
from kvcore.transfer.regions import group_selection, whole_block_patterns


def _nixl_lists() -> Any:
    """A function turning an ``Nx3`` array into NIXL's descriptor list, or None without NIXL."""
    try:
        agent_cls, config_cls = nixl_api()
        agent = agent_cls("kvcore-descriptor-bench", config_cls(backends=[]))
    except Exception:  # NOTE: NIXL may be absent (NixlUnavailableError) or unable to start here
        return None
    return lambda array: agent.get_xfer_descs(array, "DRAM")


def _per_call(desc: KVCacheDescriptor, ids: torch.Tensor, to_nixl: Any) -> int:
    """Both sides' descriptor lists built per call (the peer: this cache); the copies."""
    patterns = whole_block_patterns(desc, group_selection(desc, None))
    arrays = xfer_arrays(pair_runs(patterns, ids, patterns, ids), desc, desc)
    if to_nixl is not None:
        for array in arrays:
            to_nixl(array)
    return len(arrays[0])


def _median_ms(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def descriptor_rows_of(args: argparse.Namespace, make: Any, repeats: int = 5) -> list[dict]:
    """One row per layout and id kind for ``args.descriptors`` ids."""
    n = args.descriptors
    id_kinds = (("scattered", torch.arange(n) * 2 + 1), ("consecutive", torch.arange(n) + 1))
    to_nixl = _nixl_lists()
    rows = []
    for layout in args.layouts:
        desc = describe(make(layout.name, 2 * n + 1))
        prepared = PreparedRuns(desc, whole_block_patterns(desc, group_selection(desc, None)))
        for kind, ids in id_kinds:
            copies = _per_call(desc, ids, to_nixl)
            rows.append({
                "layout": layout.name, "blocks": n, "ids": kind, "descriptors": copies,
                "per_block": copies / n, "prepared_rows": len(prepared.rows()),
                "build_ms": _median_ms(lambda: _per_call(desc, ids, to_nixl), repeats),
                "prepared_ms": _median_ms(
                    lambda: paired_indices(prepared, prepared, ids, ids), repeats
                ),
                "nixl_dlist": to_nixl is not None,
            })
    return rows


def print_descriptor_rows(rows: list[dict[str, Any]], model: dict[str, Any], width: int) -> None:
    columns = [Column("layout"), Column("blocks", right=True), Column("ids"),
               Column("copies", right=True), Column("per block", right=True),
               Column("prepared rows", right=True), Column("per-call ms", right=True),
               Column("prepared ms", right=True)]
    nixl = " and NIXL's nixlXferDList" if rows and rows[0]["nixl_dlist"] else ""
    title = (f"NIXL descriptors of one transfer ({model['layers']} layers, {model['kv_heads']} KV "
             f"heads): copies after merging; Nx5 rows prepared once per side; host ms per call "
             f"(median), per call: plan, Nx3 arrays{nixl} for both sides; prepared: indices")
    print(render(columns, [[r["layout"], r["blocks"], r["ids"], r["descriptors"],
                            f"{r['per_block']:.3g}", r["prepared_rows"], f"{r['build_ms']:.2f}",
                            f"{r['prepared_ms']:.2f}"] for r in rows],
                 title=title, width=width))
