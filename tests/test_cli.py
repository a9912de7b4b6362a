"""The ``kvcore`` command line: --version, fast help, options that explain themselves, presets."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from importlib import metadata
from types import SimpleNamespace

import pytest

import kvcore
from kvcore.cli import _COMMANDS, _ELSEWHERE, build_parser, main
from kvcore.model_files import load_model_file, preset_names


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


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["plugins", "--help"], ["plan", "--help"], ["models", "--help"],
    ["completion", "--help"],
])  # fmt: skip
def test_help_and_version_do_not_import_torch(argv):
    done = _run(*argv, code="print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH"


def test_layout_names_for_help_are_the_enum_members():
    from kvcore.cli import LAYOUT_NAMES
    from kvcore.memory.layout import KVCacheLayout

    assert LAYOUT_NAMES == tuple(m.name for m in KVCacheLayout)


def test_models_help_names_the_preset_directory_of_kvcore_models():
    from kvcore.cli import _PRESET_DIR
    from kvcore.model_files import PRESET_DIR

    assert _PRESET_DIR == PRESET_DIR


def _parsers(parser: argparse.ArgumentParser, prog: str = "kvcore"):
    """Every (sub)parser of ``parser`` with its command words."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_help_lists_every_command_and_those_other_distributions_add():
    full = dict(_parsers(build_parser()))
    installed = {e.name for e in metadata.entry_points(group="kvcore.cli")}
    assert {p.split()[-1] for p in full if p.count(" ") == 1} == {*_COMMANDS, *_ELSEWHERE, *installed}


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
        assert str(len(load_model_file(name).kv_cache_specs)) in row.split()
    assert all(len(line) <= 80 for line in out.splitlines())
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    gemma = next(p for p in listed if p["preset"] == "gemma-3-27b")
    assert gemma["kinds"] == {"SlidingWindow": 52, "FullAttention": 10} and gemma["num_layers"] == 62


def test_a_value_error_is_printed_as_a_kvcore_error(capsys):
    assert main(["plan", "llama-3-8b", "--memory", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcore plan: error: ") and "Traceback" not in err


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


@pytest.mark.parametrize("argv, kind, text", [
    (["plan", "llama-3-8b", "--memory", "1KiB", "--json"], "ValueError", "plan with at least"),
    (["plan", "llama-3-8b", "--memory", "banana", "--json"], "usage", "argument --memory: invalid size"),
    (["models", "--json", "--bogus"], "usage", "unrecognized arguments: --bogus"),
])  # fmt: skip
def test_errors_under_json_are_a_json_object_and_exit_2(argv, kind, text, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    error = json.loads(out)["error"]
    assert code == 2 and error["type"] == kind and text in error["message"]
    assert error["command"].startswith("kvcore")


def test_without_json_a_usage_error_stays_argparse_text(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3-8b", "--memory", "banana"])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "" and "usage: kvcore plan" in captured.err


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_knows_every_command_and_option(shell, capsys, tmp_path):
    pytest.importorskip("shtab")
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for word in ("plan", "models", "plugins", "completion", "--num-blocks", "--memory", "--json"):
        assert word in script, word
    if shell == "bash" and shutil.which("bash"):
        path = tmp_path / "kvcore.bash"
        path.write_text(script)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_preset_and_layout_names(capsys, tmp_path):
    pytest.importorskip("shtab")
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "kvcore.bash"
    script.write_text(capsys.readouterr().out)
    (tmp_path / "my-model.toml").write_text("")
    complete = (f"source {script}\n"
                'COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}\n'
                '_shtab_kvcore; echo "${COMPREPLY[*]}"')

    def words(*line: str) -> set[str]:
        done = subprocess.run(["bash", "-c", complete, "bash", "kvcore", *line], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert words("plan", "--layout", "BL") == {"BLHNC", "BLNHC"}
    assert words("plan", "--layout", "") == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}
    assert words("plan", "gem") == {"gemma-3-27b"}
    assert words("plan", "my") == {"my-model.toml"}  # a model file is completed too
    assert words("models", "--j") == {"--json"}


def test_completion_without_shtab_says_what_to_install_in_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "shtab", None)  # NOTE: makes `import shtab` fail
    assert main(["completion", "bash"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "Traceback" not in out.err
    assert out.err.startswith("kvcore completion: error:") and "pip install shtab" in out.err


def test_completion_of_an_unknown_shell_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["completion", "fish"])
    assert exc.value.code == 2 and "invalid choice: 'fish'" in capsys.readouterr().err


def _no_commands_installed(monkeypatch, *found):
    """``importlib.metadata.entry_points`` that finds ``found`` in group kvcore.cli."""
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: list(found) if kw.get("group") == "kvcore.cli" else real(**kw))


@pytest.mark.parametrize("argv", [["bench", "zero"], ["bench", "--help"], ["bench", "hf", "--device", "cpu"]])
def test_bench_without_its_distribution_says_what_to_install(argv, monkeypatch, capsys):
    _no_commands_installed(monkeypatch)
    assert main(argv) == 2
    captured = capsys.readouterr()
    hint = "kvcore bench needs the kvcore-bench distribution: pip install -e benchmarks (in a checkout)"
    assert captured.err.strip() == f"kvcore bench: error: {hint}" and captured.out == ""
    assert main([*argv, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == {
        "command": "kvcore bench", "type": "ValueError", "message": hint}
    assert main(["plan", "llama-3-8b", "--num-blocks", "8", "--json"]) == 0


def _fails_to_import():
    raise ImportError("cannot import name 'ARGUMENTS' from 'kvcore_bench.options'")


def _fails_half_way():
    def add_command(commands):
        commands.add_parser("bench").add_argument("--size")  # added, then it fails
        raise ImportError("cannot import name 'ARGUMENTS' from 'kvcore_bench.options'")

    return add_command


@pytest.mark.parametrize("load", [_fails_to_import, _fails_half_way])
def test_a_command_whose_distribution_is_broken_is_named_and_the_rest_works(load, monkeypatch, capsys):
    broken = SimpleNamespace(name="bench", value="kvcore_bench.cli:add_command", load=load,
                             dist=SimpleNamespace(name="kvcore-bench"))
    _no_commands_installed(monkeypatch, broken)
    assert main(["bench", "zero", "--blocks", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcore bench: error: kvcore bench could not be loaded from kvcore-bench (ImportError: "
                          "cannot import name 'ARGUMENTS'") and "reinstall or uninstall kvcore-bench" in err
    assert "Traceback" not in err
    assert main(["models", "--json"]) == 0 and json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    assert exc.value.code == 0 and listed.count("bench") == 1


def _adds_a_command(name):
    def add_command(commands):
        commands.add_parser(name, help="another tool's command").set_defaults(func=lambda args: 0)

    return lambda: add_command


@pytest.mark.parametrize("name", ["plan", "models", "plugins", "completion"])
def test_a_distribution_cannot_take_a_built_in_command_name(name, monkeypatch, capsys):
    other = SimpleNamespace(name=name, value="other.cli:add_command", load=_adds_a_command(name),
                            dist=SimpleNamespace(name="other-tool"))
    _no_commands_installed(monkeypatch, other)
    assert main(["plan", "llama-3-8b", "--num-blocks", "8", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_blocks"] == 8
    assert f"ignoring command {name!r} of other-tool" in captured.err
    with pytest.raises(SystemExit) as exc:
        main(["completion", "fish"])
    assert exc.value.code == 2 and "invalid choice: 'fish'" in capsys.readouterr().err
