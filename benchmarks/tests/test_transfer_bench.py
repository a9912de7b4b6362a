"""``kvcore bench transfer`` reports what each layout costs per block, and NIXL rows that moved real bytes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvcore.cli import main
from kvcore_bench import BENCHMARKS, transfer

SMALL = ["--layers", "3", "--kv-heads", "2", "--head-size", "16", "--repeats", "2", "--warmup", "1"]


def collect(argv):
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    return transfer.collect(parser.parse_args(argv + SMALL))


def test_bench_transfer_reports_runs_and_bandwidth_per_layout():
    assert BENCHMARKS["transfer"] == "kvcore_bench.transfer"
    result = collect(["--layouts", "BLNHC,LBNHC,LHBNC", "--blocks", "2,4", "--nixl-blocks", "2,4",
                      "--device", "cpu"])
    per_block = {r["layout"]: r["runs_per_block"] for r in result["host"]}
    assert per_block == {"BLNHC": 1.0, "LBNHC": 3.0, "LHBNC": 6.0}  # one run; per layer; per layer and head
    page = 16 * 2 * 2 * 16 * 2  # tokens * heads * (K+V) * head size * bf16 bytes
    assert all(r["bytes"] == r["blocks"] * 3 * page and r["offload_gbps"] > 0 for r in result["host"])
    if result["nixl_skipped"]:
        pytest.skip(f"NIXL is not installed: {result['nixl_skipped']}")
    assert result["nixl_failed"] == {}
    nixl = {(r["layout"], r["blocks"]): r for r in result["nixl"]}
    assert sorted(nixl) == sorted((lay, n) for lay in per_block for n in (2, 4))
    for (layout, n), r in nixl.items():
        assert r["memory"] == "DRAM" and r["exact"] is True and r["peer"] == "local"
        assert r["transport"] == "cma" and "one process" in r["transport_detail"]
        assert r["runs"] == n * per_block[layout] and r["bytes"] == n * 3 * page
        assert r["nixl_write_gbps"] > 0 and r["nixl_read_gbps"] > 0 and r["copy_gbps"] > 0


def test_bench_transfer_refuses_vram_without_cuda():
    with pytest.raises(ValueError, match="VRAM needs a CUDA"):
        collect(["--device", "cpu", "--nixl-memory", "VRAM", "--no-host", "--blocks", "2", "--nixl-blocks", "2"])
    with pytest.raises(SystemExit):
        collect(["--nixl-memory", "HBM"])


def test_a_process_peer_without_nixl_is_skipped_at_once_not_waited_for(monkeypatch):
    from kvcore.transfer import NixlUnavailableError
    from kvcore_bench import transfer_nixl

    def missing():
        raise NixlUnavailableError("NixlAgent needs NIXL, which does not import here")

    def no_peer(*args, **kwargs):
        raise AssertionError("a peer process was started without NIXL")

    monkeypatch.setattr(transfer_nixl, "nixl_api", missing)
    monkeypatch.setattr(transfer_nixl, "ProcessPeer", no_peer)
    result = collect(["--device", "cpu", "--no-host", "--layouts", "BLNHC", "--nixl-blocks", "2",
                      "--nixl-peer", "process"])
    assert "does not import" in result["nixl_skipped"] and result["nixl_failed"] == {} and result["nixl"] == []


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_transfer_moves_vram_blocks_over_nixl():
    result = collect(["--device", "cuda", "--no-host", "--layouts", "BLNHC,LHBNC", "--nixl-blocks", "2,8",
                      "--nixl-memory", "VRAM", "--nixl-peer", "process"])
    if result["nixl_skipped"]:
        pytest.skip(f"NIXL is not installed: {result['nixl_skipped']}")
    assert result["nixl_failed"] == {} and len(result["nixl"]) == 4
    assert all(r["memory"] == "VRAM" and r["exact"] is True and r["h2d_memcpy_gbps"] > 0 for r in result["nixl"])
    assert {r["transport"] for r in result["nixl"]} <= {"cuda_ipc", "cuda_copy+tcp"}


def test_bench_transfer_cli_prints_tables_within_80_columns_and_no_raw_dict(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["bench", "transfer", "--device", "cpu", "--layouts", "BHLNC", "--blocks", "2", "--nixl-blocks", "2",
            *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "offload" in out and "x memcpy" in out and "3 layers, 2 KV heads of 16" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "{" not in out and "NIXL INFO" not in out
    if "NIXL rows skipped" not in out:
        assert "transport" in out and "cma" in out
    assert main([*argv, "--json", "--no-nixl"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["layers"] == 3


def test_bench_transfer_bad_device_is_a_usage_error(capsys):
    for device in ("banana", "tpu", *([] if torch.cuda.is_available() else ["cuda"])):
        with pytest.raises(SystemExit) as info:
            main(["bench", "transfer", "--device", device])
        assert info.value.code == 2
        assert f"argument --device: {device!r}" in capsys.readouterr().err


def test_bench_transfer_defaults_are_cpu_sized_without_cuda():
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    args = transfer.resolve(parser.parse_args(["--device", "cpu"]))
    assert (args.layers, args.blocks, args.nixl_blocks, args.nixl_peer) == (4, [4, 32], [8], "local")
    assert len(args.layouts) == 6
    args = transfer.resolve(parser.parse_args(["--device", "cpu", "--layers", "7", "--nixl-peer", "process"]))
    assert (args.layers, args.nixl_peer) == (7, "process")


def test_bench_transfer_descriptors_counts_copies_and_prepared_rows(capsys, monkeypatch):
    """Layer-compact layouts: a copy per layer and block, but only a prepared row per layer."""
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["bench", "transfer", "--descriptors", "6", "--layouts", "LBNHC,BLNHC", "--layers", "4",
            "--kv-heads", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per-call ms" in out and "prepared ms" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert main([*argv, "--json"]) == 0
    rows = {(r["layout"], r["ids"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows["LBNHC", "scattered"]["descriptors"] == 4 * 6 and rows["LBNHC", "consecutive"]["descriptors"] == 4
    assert rows["LBNHC", "scattered"]["prepared_rows"] == 4
    assert rows["BLNHC", "scattered"]["descriptors"] == 6 and rows["BLNHC", "consecutive"]["descriptors"] == 1
    assert rows["BLNHC", "consecutive"]["prepared_rows"] == 1
    assert all(r["prepared_ms"] > 0 and r["build_ms"] > 0 for r in rows.values())


def test_cpu_references_are_timed_on_one_thread_and_implausible_ones_are_named(capsys, monkeypatch):
    threads = torch.get_num_threads()
    seen = []
    real = transfer.collect
    monkeypatch.setattr(transfer, "collect", lambda args, progress=None: seen.append(torch.get_num_threads())
                        or real(args, progress))  # fmt: skip
    assert main(["bench", "transfer", "--device", "cpu", "--layouts", "BLNHC", "--blocks", "4", "--no-nixl",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert seen == [1] and torch.get_num_threads() == threads  # one thread while it runs, restored after
    assert result["torch_threads"] == 1 and result["copy_gbps"] > 0.1
    row = result["host"][0]
    assert transfer.implausible(result) == [] or row["d2h_memcpy_gbps"] < result["copy_gbps"] / 10
    slow = {**result, "host": [{**row, "d2h_memcpy_us": 1e6, "d2h_memcpy_gbps": row["bytes"] / 1e9}]}
    assert transfer.implausible(slow) == [f"{row['bytes'] / 1e9:.2f} GB/s ({row['bytes'] // 1024} KiB)"]
    assert transfer.implausible({**slow, "copy_gbps": None}) == []  # GPU rows: CUDA events, no check
