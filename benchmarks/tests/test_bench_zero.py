"""``kvcore bench zero``: argument parsing, dispatch, and the result schema on a tiny CPU run."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from kvcore.cli import build_parser, main
from kvcore.memory.layout import KVCacheLayout
from kvcore_bench import zero


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "zero", *argv])


def test_arguments_parse_lists_and_layouts(monkeypatch):
    args = _parse("--blocks", "1,3", "--layouts", "lbnhc,BHLNC", "--layers", "2", "--json")
    assert args.blocks == [1, 3]
    assert args.layouts == [KVCacheLayout.LBNHC, KVCacheLayout.BHLNC]
    assert args.layers == 2 and args.json
    # The parser imports the benchmark module only when it runs: func calls zero.run then.
    monkeypatch.setattr(zero, "run", lambda got: 7 if got is args else 0)
    assert args.func(args) == 7
    defaults = _parse()
    assert defaults.blocks == [1, 8, 64, 512, 4096]
    assert [l.name for l in defaults.layouts] == ["LBNHC", "BLNHC", "LHBNC"]
    with pytest.raises(SystemExit):
        _parse("--layouts", "ZZZ")


def test_plan_is_registered_only_when_installed():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    names = set(bench._subparsers._group_actions[0].choices)
    assert "zero" in names
    assert ("plan" in names) == (importlib.util.find_spec("kvcore_bench.plan") is not None)


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
        for key in ("zeroer_us", "zeroer_list_us", "zeroer_host_us", "zeroer_wall_us", "loop_us", "loop_wall_us",
                    "zero_us"):
            assert row[key] > 0
        assert row["memset_us"] is None and row["bw_vs_memset"] is None
        assert row["speedup_vs_loop"] == pytest.approx(row["loop_us"] / row["zeroer_us"])
        assert row["zeroer_gbps"] == pytest.approx(row["bytes"] / row["zeroer_us"] / 1e3)
    assert result["empty_launch_us"] > 0
    assert {t["target"] for t in result["targets"]} >= {"bandwidth vs zero_() at >= 512 blocks"}


def _row(blocks, zeroer_us, loop_wall_us, zero_us, memset_us, host_us=None, list_us=None):
    r = {"layout": "LBNHC", "blocks": blocks, "bytes": blocks * 1000, "zeroer_us": zeroer_us,
         "zeroer_list_us": list_us if list_us is not None else zeroer_us * 0.9,
         "zeroer_host_us": host_us if host_us is not None else zeroer_us / 2,
         "zeroer_wall_us": zeroer_us, "loop_us": loop_wall_us, "loop_wall_us": loop_wall_us,
         "zero_us": zero_us, "memset_us": memset_us}
    return zero._derive(r)


def test_targets_report_the_worst_row():
    row = _row

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
    host = by_name["host time per call (us) at <= 64 blocks"]
    assert host["worst"] == pytest.approx(10.0 / 2) and host["met"] is True
    # One block: 3.0 us on device ids, 2.7 us through a host list, against memset's 2.5 us.
    device = by_name["one block (device ids): time / memset time"]
    assert device["worst"] == pytest.approx(3.0 / 2.5) and device["met"] is False
    listed = by_name["one block (host list, as begin_step): time / memset time"]
    assert listed["worst"] == pytest.approx(2.7 / 2.5) and listed["met"] is True


def test_host_target_fails_above_15_us():
    rows = [_row(1, 3.0, 600.0, 2.0, 2.5, host_us=14.0), _row(64, 10.0, 900.0, 8.0, 9.0, host_us=42.0),
            _row(512, 100.0, 9e4, 120.0, 95.0, host_us=400.0)]
    host = {t["target"]: t for t in zero.targets({"rows": rows, "empty_launch_us": 2.0})}[
        "host time per call (us) at <= 64 blocks"
    ]
    assert host["worst"] == 42.0 and host["met"] is False  # the 512-block row is not covered


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--blocks", "1,-8"], ["--layers", "0"],
                                  ["--kv-heads", "-1"], ["--warmup", "0"], ["--layouts", ""]])
def test_bad_values_exit_2_naming_the_option(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "zero", *argv])
    assert exc.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


def test_a_pool_smaller_than_a_call_is_refused(capsys):
    assert main(["bench", "zero", "--blocks", "1,8", "--pool-blocks", "4"]) == 2
    assert "--pool-blocks 4 is fewer than the 8 blocks" in capsys.readouterr().err


def test_tables_fit_80_columns_and_cut_nothing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rows = [_row(1, 6.12, 612.5, 7.5, 5.25, host_us=13.75),
            _row(4096, 1843.25, 1.5e6, 2371.0, 1779.5, host_us=16.5)]
    rows[1]["layout"], rows[1]["bytes"] = "BHLNC", 4096 * 2 << 20
    result = {"device": "NVIDIA H200", "empty_launch_us": 3.5, "memset": "cudaMemsetAsync",
              "rows": rows}
    result["targets"] = zero.targets(result)
    zero._print_table(result)
    out = capsys.readouterr().out
    assert all(len(line) <= 80 and "…" not in line for line in out.splitlines())
    words = out.split()
    for value in ("BHLNC", "4096", "8", "GiB", "1843.25", "16.50", "13.75", "1500000.0", "0.97"):
        assert value in words, value
