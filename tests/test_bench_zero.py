"""``kvcore bench zero``: argument parsing, dispatch, and the result schema on a tiny CPU run."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from kvcore.bench import zero
from kvcore.cli import build_parser, main
from kvcore.memory.layout import KVCacheLayout


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "zero", *argv])


def test_arguments_parse_lists_and_layouts():
    args = _parse("--blocks", "1,3", "--layouts", "lbnhc,BHLNC", "--layers", "2", "--json")
    assert args.blocks == [1, 3]
    assert args.layouts == [KVCacheLayout.LBNHC, KVCacheLayout.BHLNC]
    assert args.layers == 2 and args.json and args.func is zero.run
    defaults = _parse()
    assert defaults.blocks == [1, 8, 64, 512, 4096]
    assert [l.name for l in defaults.layouts] == ["LBNHC", "BLNHC", "LHBNC"]
    with pytest.raises(SystemExit):
        _parse("--layouts", "ZZZ")


def test_plan_is_registered_only_when_installed():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    names = set(bench._subparsers._group_actions[0].choices)
    assert "zero" in names
    assert ("plan" in names) == (importlib.util.find_spec("kvcore.bench.plan") is not None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_without_cuda_exits_2_with_a_message(capsys):
    assert main(["bench", "zero", "--blocks", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run needs TRITON_INTERPRET=1")
def test_tiny_cpu_run_has_the_json_schema():
    args = _parse("--blocks", "1,2", "--layouts", "LBNHC,LHBNC", "--layers", "2", "--kv-heads", "2",
                  "--head-size", "4", "--block-size", "4", "--repeats", "2", "--warmup", "1")
    result = json.loads(json.dumps(zero.collect(args, "cpu")))
    page = 2 * 4 * (4 + 4) * 2  # heads * tokens * (K + V) * bf16
    assert [(r["layout"], r["blocks"]) for r in result["rows"]] == [
        ("LBNHC", 1), ("LBNHC", 2), ("LHBNC", 1), ("LHBNC", 2)
    ]
    for row in result["rows"]:
        assert row["bytes"] == row["blocks"] * 2 * page
        for key in ("zeroer_us", "zeroer_wall_us", "loop_us", "loop_wall_us", "zero_us"):
            assert row[key] > 0
        assert row["memset_us"] is None and row["bw_vs_memset"] is None
        assert row["speedup_vs_loop"] == pytest.approx(row["loop_us"] / row["zeroer_us"])
        assert row["zeroer_gbps"] == pytest.approx(row["bytes"] / row["zeroer_us"] / 1e3)
    assert result["empty_launch_us"] > 0
    assert {t["target"] for t in result["targets"]} >= {"bandwidth vs zero_() at >= 512 blocks"}


def test_targets_report_the_worst_row():
    def row(blocks, zeroer_us, loop_wall_us, zero_us, memset_us):
        r = {"layout": "LBNHC", "blocks": blocks, "bytes": blocks * 1000, "zeroer_us": zeroer_us,
             "zeroer_wall_us": zeroer_us, "loop_us": loop_wall_us, "loop_wall_us": loop_wall_us,
             "zero_us": zero_us, "memset_us": memset_us}
        return zero._derive(r)

    rows = [row(1, 3.0, 600.0, 2.0, 2.5), row(64, 10.0, 900.0, 8.0, 9.0),
            row(512, 100.0, 9e4, 120.0, 95.0), row(4096, 800.0, 7e5, 850.0, 790.0)]
    result = {"rows": rows, "empty_launch_us": 2.0}
    by_name = {t["target"]: t for t in zero.targets(result)}
    loop = by_name["speedup vs per-layer loop (wall) at <= 64 blocks"]
    assert loop["worst"] == pytest.approx(min(600 / 3, 900 / 10)) and loop["met"] is False
    bw = by_name["bandwidth vs zero_() at >= 512 blocks"]
    assert bw["worst"] == pytest.approx(850 / 800) and bw["met"] is False
    assert by_name["one block: time / empty launch time"]["worst"] == pytest.approx(1.5)
    assert by_name["one block: time / empty launch time"]["met"] is True
    assert by_name["bandwidth vs memset at >= 512 blocks"]["worst"] == pytest.approx(min(95 / 100, 790 / 800))
