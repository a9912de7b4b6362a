"""``kvcore bench`` on the kvcore command line: fast help, lazy imports, options, usage errors."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

import kvcore_bench
import kvcore_bench.options
from kvcore.cli import build_parser, main


def _run(*argv: str, code: str = "") -> subprocess.CompletedProcess:
    """``kvcore ARGV`` in a fresh interpreter, then ``code`` (e.g. printing sys.modules)."""
    script = (
        "import sys\nfrom kvcore.cli import main\n"
        f"try:\n    rc = main({list(argv)!r})\nexcept SystemExit as exc:\n    rc = exc.code\n{code}\n"
        "sys.exit(rc)"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


@pytest.mark.parametrize("argv", [
    ["--help"], ["bench", "--help"], ["bench", "zero", "--help"], ["bench", "plan", "--help"],
    ["bench", "hf", "--help"], ["bench", "pool", "--help"], ["bench", "transfer", "--help"],
    ["bench", "elastic", "--help"],
])  # fmt: skip
def test_help_does_not_import_torch(argv):
    done = _run(*argv, code="print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH"
    assert "bench" in done.stdout


def test_a_benchmark_module_is_imported_only_when_it_runs():
    code = "print(sorted(m for m in sys.modules if m.startswith('kvcore_bench.')))"
    done = _run("bench", "plan", "--help", code=code)
    assert done.returncode == 0
    loaded = done.stdout.strip().splitlines()[-1]
    assert "kvcore_bench.options" in loaded and "kvcore_bench.plan" not in loaded
    done = _run("bench", "plan", "--layers", "4", "--repeat", "1", "--layouts", "LBNHC", "--json", code=code)
    loaded = done.stdout.strip().splitlines()[-1]
    assert "kvcore_bench.plan" in loaded and "kvcore_bench.zero" not in loaded


@pytest.mark.parametrize("name", sorted(kvcore_bench.options.ARGUMENTS))
def test_each_benchmark_module_adds_the_options_the_command_line_shows(name):
    """The module's own add_arguments (for callers that import it) is the one in options."""
    module = importlib.import_module(kvcore_bench.BENCHMARKS[name])
    assert module.add_arguments is kvcore_bench.options.ARGUMENTS[name]


def test_help_lists_every_benchmark():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert set(bench._subparsers._group_actions[0].choices) == set(kvcore_bench.BENCHMARKS)


@pytest.mark.parametrize("device", ["banana", "cuda:x", "meta", "cuda:99"])
def test_a_bad_device_is_a_usage_error(device, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "hf", "--device", device])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "argument --device" in err and repr(device) in err


def test_device_arg_takes_the_cpu_and_refuses_cuda_without_a_gpu(monkeypatch):
    import torch

    from kvcore_bench.options import device_arg

    assert device_arg("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError, match="no CUDA device; use --device cpu"):
        device_arg("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_arg("cuda:0") == torch.device("cuda:0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"has 1 CUDA device \(cuda:0\)"):
        device_arg("cuda:1")


def test_a_usage_error_under_json_names_the_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "hf", "--json", "--device", "banana"])
    error = json.loads(capsys.readouterr().out)["error"]
    assert exc.value.code == 2 and error["type"] == "usage" and "'banana' is not a device" in error["message"]
    assert error["command"] == "kvcore bench hf"


def test_a_value_error_names_the_benchmark(capsys):
    assert main(["bench", "zero", "--blocks", "1,8", "--pool-blocks", "4", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["command"] == "kvcore bench zero" and error["type"] == "ValueError"


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_knows_every_benchmark_and_its_options(shell, capsys):
    pytest.importorskip("shtab")
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for word in ("bench", *kvcore_bench.BENCHMARKS, "--pool-blocks", "--device", "--nixl-memory"):
        assert word in script, word


@pytest.mark.parametrize("argv", [["bench", "--help"], *(["bench", name, "--help"] for name in kvcore_bench.BENCHMARKS),
                                  ["completion", "--help"]], ids=" ".join)
def test_help_fits_80_columns(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
