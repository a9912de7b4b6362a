"""``bench_decode.py`` runs end to end at a tiny shape (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_agrees_with_sdpa_and_torch(bench, capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--batch", "3", "--context", "80", "--q-heads", "4", "--kv-heads", "2", "--head-size", "16",
            "--block-size", "16,32", "--num-layers", "2", "--dtype", "fp32", "--tile", "16", "--num-splits", "2",
            "--warmup", "0", "--iters", "1", "--variants", "base,pointer", "--device", device, "--json"]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {(r["block_size"], r["layout"], r["variant"]) for r in result["rows"]} == {
        (b, layout, v) for b in (16, 32) for layout in ("LBNHC", "BLNHC") for v in ("base", "pointer")
    }
    for row in result["rows"]:
        assert row["decode_ms"] > 0 and row["max_abs_diff_vs_sdpa"] < 1e-3
        # tile 16 fits every kernel block here: the default reads by TMA, KV heads side by side.
        want = ("tma", "head") if row["variant"] == "base" else ("pointer", "request")
        assert (row["path"], row["grid"]) == want
    assert len(result["best"]) == 4
    for best in result["best"]:
        assert best["max_abs_diff_vs_torch_backend"] < 1e-3 and best["decode_host_us"] > 0
    for base in result["baselines"]:
        assert base["kv_bytes"] == 3 * 80 * 2 * 2 * 16 * 4 and base["sdpa_ms"] > 0


def test_cpu_without_interpreter_refuses(bench, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench.main(["--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_quantized_modes_decode_beside_bf16_in_one_run(bench, capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = ["fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
    argv = ["--batch", "2", "--context", "40", "--q-heads", "4", "--kv-heads", "2", "--head-size", "16",
            "--block-size", "16", "--num-layers", "2", "--dtype", "fp32", "--tile", "16", "--warmup", "0",
            "--iters", "1", "--layouts", "LBNHC", "--device", device, "--skip-torch-check", "--json",
            "--kv-cache-dtype", ",".join(modes)]
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["kv_cache_dtype"]: r for r in result["quantized"]}
    assert list(rows) == modes
    data = 2 * 40 * 2 * 2 * 16  # one byte per element
    for mode, row in rows.items():
        assert row["kv_bytes"] == data + (2 * 40 * 2 * 8 if mode.endswith("head") else 0)
        assert row["decode_ms"] > 0 and row["speedup_over_bf16"] > 0
        assert 0 < row["rel_l2_vs_sdpa"] < (1e-2 if mode.startswith("int8") else 1e-1)


def test_unknown_modes_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--kv-cache-dtype", "fp4", "--device", "cpu"])
    assert "fp4" in capsys.readouterr().err
