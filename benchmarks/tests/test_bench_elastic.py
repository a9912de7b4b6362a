"""``kvcore bench elastic``: what growing an elastic KV cache costs per layout, from the plan."""

from __future__ import annotations

from kvcore.cli import main
from kvcore.memory.layout import KVCacheLayout as L
from kvcore.model_files import load_model_file
from kvcore_bench.elastic import layout_cost


def test_layout_costs_of_llama_at_2mib_granules(capsys):
    specs = load_model_file("llama-3-8b").kv_cache_specs
    rows = {n: layout_cost(specs, L[n], 512, 2 * 2**20) for n in ("BHLNC", "LBNHC", "LHBNC")}
    assert all(rows[n]["block_bytes"] == 2 * 2**20 for n in rows)  # 32 layers x 64 KiB
    # a block is one granule: a grow maps one per block
    assert (rows["BHLNC"]["granules_per_block"], rows["BHLNC"]["mappings_per_grow_event"]) == (1.0, 1.0)
    # one 32 MiB run per layer: 32 granules per block, 32 maps every 32 blocks
    assert rows["LBNHC"]["granules_per_block"] == 32.0 and rows["LBNHC"]["mappings_per_grow_event"] == 32.0
    assert rows["LBNHC"]["grow_events"] == 15 and rows["LBNHC"]["max_slack_bytes"] == 31 * 2 * 2**20
    assert rows["LHBNC"]["pieces_per_block"] == 256 and rows["LHBNC"]["granules_per_block"] == 256.0
    # 600 blocks: runs of 37.5 MiB straddle granules, so the layers' grows fall on different blocks
    unaligned = layout_cost(specs, L.LBNHC, 600, 2 * 2**20)
    assert unaligned["mappings_per_grow_event"] < 32
    assert unaligned["grow_events"] * unaligned["mappings_per_grow_event"] + 32 == 600  # 1,200 MiB in all
    assert main(["bench", "elastic", "--max-blocks", "64"]) == 0
    assert "LHBNC" in capsys.readouterr().out


def test_measure_on_a_cpu_times_what_backs_the_memory(capsys, monkeypatch):
    import json

    monkeypatch.setenv("COLUMNS", "80")
    argv = ["bench", "elastic", "--measure", "--device", "cpu", "--max-blocks", "16", "--repeat", "3"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    backing = result["backing"]
    # a CPU backs pages when first written: committing a GiB writes 262,144 pages, not a free check
    assert backing["held_grown_bytes"] >= 0.9 * 2**30 and backing["commit_gib_ms"] > 10
    assert all(r["grow_ms"] > 0 and r["granules"] > 0 for r in result["resize"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "commit times include writing one byte per page" in out.replace("\n", " ")
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
