"""The ``kvcore`` command line: --version, fast help, options that explain themselves, presets."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvcore
import kvcore.bench
from kvcore.cli import _COMMANDS, build_parser, main
from kvcore.models import load_model, preset_names


def _run(*argv: str, code: str = "") -> subprocess.CompletedProcess:
    """``kvcore ARGV`` in a fresh interpreter, then ``code`` (e.g. printing sys.modules)."""
    script = (
        "import sys\nfrom kvcore.cli import main\n"
        f"try:\n    rc = main({list(argv)!r})\nexcept SystemExit as exc:\n    rc = exc.code\n{code}\n"
        "sys.exit(rc)"
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"kvcore {kvcore.__version__}"


def test_python_dash_m_kvcore_prints_the_version():
    done = subprocess.run([sys.executable, "-m", "kvcore", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"kvcore {kvcore.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["bench", "--help"], ["plugins", "--help"]])
def test_help_and_version_do_not_import_torch(argv):
    done = _run(*argv, code="print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH"


def test_a_benchmark_imports_only_its_own_module():
    code = "print(sorted(m for m in sys.modules if m.startswith('kvcore.bench.')))"
    done = _run("bench", "plan", "--help", code=code)
    assert done.returncode == 0
    loaded = done.stdout.strip().splitlines()[-1]
    assert "kvcore.bench.plan" in loaded and "kvcore.bench.zero" not in loaded


def _parsers(parser: argparse.ArgumentParser, prog: str = "kvcore"):
    """Every (sub)parser of ``parser`` with its command words."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_lazy_help_lists_the_same_commands_as_the_full_parser():
    assert build_parser(["--help"]).format_help() == build_parser().format_help()
    full = dict(_parsers(build_parser()))
    lazy = dict(_parsers(build_parser(["bench", "--help"])))
    assert lazy["kvcore bench"].format_help() == full["kvcore bench"].format_help()
    assert set(_COMMANDS) <= set(full) | {p.split()[-1] for p in full}


_ALL = dict(_parsers(build_parser()))


@pytest.mark.parametrize("prog", sorted(_ALL))
def test_every_option_has_help_and_shows_its_default(prog):
    for action in _ALL[prog]._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        assert action.help, f"{prog} {action.option_strings[0]} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in action.help, f"{prog} {action.option_strings[0]} hides its default"


def test_memory_help_explains_binary_and_decimal_units(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "40G = 40GiB" in out and "40GB = 40 x 10^9 bytes" in out


def test_models_lists_every_preset(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        row = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert str(len(load_model(name).kv_cache_specs)) in row.split()
    assert all(len(line) <= 80 for line in out.splitlines())
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    gemma = next(p for p in listed if p["preset"] == "gemma-3-27b")
    assert gemma["kinds"] == {"SlidingWindow": 52, "FullAttention": 10} and gemma["num_layers"] == 62


def test_a_value_error_is_printed_as_a_kvcore_error(capsys):
    assert main(["plan", "llama-3-8b", "--memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcore plan: error: ") and "Traceback" not in err


def test_benchmarks_never_import_the_command_line():
    """Imports point down the package: kvcore.bench sits below kvcore.cli (issue #13)."""
    for path in Path(kvcore.bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "kvcore.cli" or n.startswith("kvcore.cli.") for n in names), path.name


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``kvcore plan ... --json | head``: a closed pipe ends the command quietly."""
    model = tmp_path / "deep.toml"
    model.write_text('num_layers = 2000\n[types.a]\nkind = "full"\nnum_kv_heads = 1\n'
                     'head_size = 8\ndtype = "float16"\n')
    proc = subprocess.Popen([sys.executable, "-m", "kvcore", "plan", str(model), "--num-blocks", "4",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(100).startswith(b"{")
    proc.stdout.close()  # more than a pipe buffer is still to come
    err = proc.stderr.read().decode()
    assert proc.wait() == 1 and "Traceback" not in err and "BrokenPipe" not in err
