"""``kvcore bench transfer`` runs on CPU and reports what each layout costs per block."""

from __future__ import annotations

import argparse

from kvcore.bench import BENCHMARKS, transfer


def test_bench_transfer_reports_runs_and_bandwidth_per_layout(tmp_path):
    assert BENCHMARKS["transfer"] == "kvcore.bench.transfer"
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    args = parser.parse_args(
        ["--layouts", "BLNHC,LBNHC,LHBNC", "--blocks", "2,4", "--layers", "3", "--kv-heads", "2",
         "--head-size", "16", "--repeats", "2", "--warmup", "1", "--nixl-blocks", "4", "--device", "cpu"]
    )
    result = transfer.collect(args)
    per_block = {r["layout"]: r["runs_per_block"] for r in result["host"]}
    assert per_block == {"BLNHC": 1.0, "LBNHC": 3.0, "LHBNC": 6.0}  # one run; per layer; per layer and head
    page = 16 * 2 * 2 * 16 * 2  # tokens * heads * (K+V) * head size * bf16 bytes
    assert all(r["bytes"] == r["blocks"] * 3 * page and r["offload_gbps"] > 0 for r in result["host"])
    assert result["nixl"] or result["nixl_skipped"]
    assert all(r["nixl_gbps"] > 0 for r in result["nixl"])
