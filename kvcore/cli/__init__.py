"""The kvcore command line: plan a model's KV cache, list presets and plugins, benchmark.

Options are defined here without torch, so help and usage errors come back at once; the module
that runs a command (torch and all) is imported when it runs. Other distributions add commands
through entry point group ``kvcore.cli`` (``kvcore bench``: kvcore-bench, in benchmarks/).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import re
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcore import __version__
from kvcore._units import SIZE_UNITS_HELP, parse_size

if TYPE_CHECKING:
    from kvcore.memory.layout import KVCacheLayout

# NOTE: where kvcore.model_files keeps the presets (a test checks they agree); that
# module imports torch, so it is imported only when a command runs.
_PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"
#: Command name -> its one-line help and its description.
_COMMANDS = {
    "plan": ("plan a model's KV cache for a memory budget",
             "Plan the KV cache of a model described in TOML (a file, or a preset: see 'kvcore "
             "models') and show its groups, tensors, bytes per block, block count and "
             f"capacity. Sizes: {SIZE_UNITS_HELP}."),
    "models": ("list the model presets that kvcore plan knows",
               f"List the model presets (TOML files in {_PRESET_DIR}) that 'kvcore plan NAME' "
               "takes by name: their layers and layer kinds. Any other model is a TOML file in "
               "the same format (see docs/model-files.md)."),
    "plugins": ("list and health-check installed kvcore plugins",
                "List every kvcore plugin (entry points in group kvcore.plugins) with its "
                "status, hooks and backends; ask every backend's hooks once about a "
                "representative full-attention spec and show the kernel block sizes and layouts "
                "it declares. Exits 1 when a plugin failed, conflicts with another or answers a "
                "hook badly."),
    "completion": ("print a shell completion script (bash, zsh, tcsh)",
                   "The script is generated from kvcore's own parser by shtab, so it knows every\n"
                   "command, benchmark and option, and the preset and layout names. Install it\n"
                   "once, e.g. for bash (or zsh, into ~/.zfunc/_kvcore):\n\n"
                   "    kvcore completion bash > "
                   "~/.local/share/bash-completion/completions/kvcore"),
}
#: Commands that other distributions add -> what to install when one is missing.
_ELSEWHERE = {"bench": "kvcore bench needs the kvcore-bench distribution: pip install -e "
              "benchmarks (in a checkout)"}
# NOTE: KVCacheLayout's member names, so that help text needs no torch; a test checks they match.
LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
#: Seconds completion waits for another distribution's command to import (then: its name only).
_IMPORT_WAIT = 10.0
#: ``kvcore.specs.quant.KV_CACHE_DTYPES`` (named here so that parsing imports no torch).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head")
# A value such as -5GiB: argparse would take it for an option (see _attach_negative_values).
_NEGATIVE_WITH_UNIT = re.compile(r"^-[0-9.]+\s*[A-Za-z]+$")


def size_arg(text: str) -> int:
    """argparse type (also the benchmarks'): a byte size such as ``40GiB``; see kvcore._units."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_arg(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def layout_arg(text: str) -> KVCacheLayout:
    """An argparse type: a layout name (any case)."""
    from kvcore.memory.layout import KVCacheLayout

    try:
        return KVCacheLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _JsonErrorParser(argparse.ArgumentParser):
    """A parser (and sub-parsers) whose usage errors are a JSON object on stdout, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        _print_json_error(self.prog, "usage", message)
        self.exit(2)


def _print_json_error(command: str, kind: str, message: str) -> None:
    error = {"command": command, "type": kind, "message": message}
    print(json.dumps({"error": error}, indent=2))
    sys.stdout.flush()


def _lazy(module_name: str, function: str = "run"):
    """``module_name.function``, importing the module (torch and all) only when called."""
    return lambda args: getattr(importlib.import_module(module_name), function)(args)


def build_parser(*, json_errors: bool = False, load: str | None = "*") -> argparse.ArgumentParser:
    """The ``kvcore`` parser; ``json_errors``: usage errors as JSON objects; ``load``: which
    other distributions' commands to import, ``"*"`` all (what completion needs), a command
    name that one, None none (each is still listed by name)."""
    parser_class = _JsonErrorParser if json_errors else argparse.ArgumentParser
    parser = parser_class(prog="kvcore", description=__doc__.splitlines()[0],
                          epilog="Run 'kvcore COMMAND --help' for the options of one command.")
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, func, **kwargs) -> argparse.ArgumentParser:
        summary, description = _COMMANDS[name]
        parser = sub.add_parser(name, help=summary, description=description, **kwargs)
        parser.set_defaults(func=func)
        return parser

    plan = command("plan", _lazy("kvcore.cli.plan"))
    plan.add_argument("model",
                      help="a model TOML file, or a preset name ('kvcore models' lists them)")
    budget = plan.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", type=size_arg, metavar="SIZE", help="KV cache memory, e.g. "
                        "40GiB (= 40G, binary) or 80GB (decimal, 10^9 bytes)")
    budget.add_argument("--num-blocks", type=positive_int_arg, metavar="N",
                        help="plan exactly N blocks")
    plan.add_argument("--layout", type=layout_arg, default="LBNHC", help="physical layout, one "
                      f"of {', '.join(LAYOUT_NAMES)} (default: %(default)s)")
    plan.add_argument("--block-size", type=positive_int_arg, metavar="TOKENS",
                      help="block size for every layer type (default: the model file's)")
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, metavar="MODE", help="store attention layers "
                      f"as one of {', '.join(KV_CACHE_DTYPES)} (default: the model file's, else its dtype)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--explain", action="store_true",
                      help="also negotiate with the installed backends ('auto' for every attention layer) and "
                      "say why each layer gets its backend, kernel block size and the layout")
    plan.add_argument("--device", default="cpu",
                      help="the device --explain negotiates for, e.g. cuda (default: %(default)s)")
    models = command("models", _lazy("kvcore.cli.plan", "run_models"))
    models.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    plugins = command("plugins", _lazy("kvcore.cli.plugins"))
    plugins.add_argument("--json", action="store_true",
                         help="print a JSON list, one object per plugin")
    completion = command("completion", _completion,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    completion.add_argument("shell", choices=("bash", "zsh", "tcsh"),
                            help="the shell to complete in")
    _add_installed_commands(sub, load)
    return parser


def _add_installed_commands(sub: argparse._SubParsersAction, load: str | None) -> None:
    """Add each entry point of group ``kvcore.cli`` to ``sub`` as a command of its name,
    importing those ``load`` names (see :func:`build_parser`): a command that hangs, exits or
    prints when imported touches no other. One not installed, or whose distribution fails to
    load, answers with the remedy."""
    unavailable = dict(_ELSEWHERE)
    for entry_point in metadata.entry_points(group="kvcore.cli"):
        name = entry_point.name
        where = entry_point.dist.name if entry_point.dist else entry_point.value
        if name in sub.choices:
            print(f"kvcore: ignoring command {name!r} of {where}: kvcore already has one by that "
                  "name; rename its entry point in group kvcore.cli", file=sys.stderr)
            continue
        unavailable.pop(name, None)
        if load not in ("*", name):  # NOTE: listed by name only; main asks for it by name
            sub.add_parser(name, help=f"a command of {where}", add_help=False)
            continue
        # NOTE: what a distribution that fails half-way added is taken back; the stub replaces it
        choices, actions = dict(sub.choices), list(sub._choices_actions)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # NOTE: no print of its reaches stdout
                (entry_point.load() if load == name else _import(entry_point, _IMPORT_WAIT))(sub)
        except BaseException as exc:  # NOTE: SystemExit and Ctrl-C too: this command fails, named
            sub.choices.clear()
            sub.choices.update(choices)
            sub._choices_actions[:] = actions
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            unavailable[name] = (f"kvcore {name} could not be loaded from {where} ({error}); "
                                 f"reinstall or uninstall {where} (uninstall it if it hangs)")
    for name, reason in unavailable.items():
        if name in sub.choices:
            continue
        # NOTE: no prefix characters: every word after the command, --help too, is an argument
        # of a command that only says why it cannot run (exit 2).
        stub = sub.add_parser(name, help="unavailable: run it to see why", description=reason,
                              prefix_chars="\0", add_help=False)
        stub.add_argument("words", nargs="*", help="ignored")
        stub.set_defaults(func=functools.partial(_unavailable, reason))


def _import(entry_point: metadata.EntryPoint, wait: float) -> Any:
    """``entry_point.load()`` in a daemon thread, given up after ``wait`` seconds; what it
    raises (``SystemExit`` too) is raised here."""
    got: list = []

    def run() -> None:
        try:
            got.append(entry_point.load())
        except BaseException as exc:  # NOTE: raised again in the caller's thread
            got.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait)
    if not got:
        raise TimeoutError(f"still importing after {wait} s")
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def _unavailable(reason: str, args: argparse.Namespace) -> int:
    raise ValueError(reason)


def _completion(args: argparse.Namespace) -> int:
    try:
        import shtab  # a dependency of kvcore, imported only here (it is not needed for help)
    except ImportError:
        raise ValueError("completion scripts are made by shtab, which does not import here; "
                         "`pip install shtab` (kvcore depends on it)") from None

    parser = build_parser()
    _complete_names(parser)
    print(shtab.complete(parser, shell=args.shell))
    return 0


def _complete_names(parser: argparse.ArgumentParser) -> None:
    """Let shtab complete layout names (``--layout``, ``--layouts``) and preset names or files (a
    ``model`` without choices) in every command of ``parser``, a parser made for completion only."""
    presets = " ".join(sorted(p.stem for p in _PRESET_DIR.glob("*.toml")))
    models = {"bash": "_kvcore_models", "tcsh": f"({presets})", "preamble": {"bash": f'_kvcore_models() {{ '
              f'compgen -W "{presets}" -- "$1"; compgen -f -- "$1"; }}'},
              "zsh": f"{{_alternative 'presets:preset:({presets})' 'files:file:_files'}}"}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _complete_names(command)
        elif action.dest in ("layout", "layouts"):
            action.choices = LAYOUT_NAMES
        elif action.dest == "model" and action.choices is None:
            action.complete = models


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--memory -5GiB`` as ``--memory=-5GiB``, so that the value's type says what is wrong
    (argparse would read the lone token as an option: "expected one argument")."""
    out: list[str] = []
    for token in argv:
        option = out[-1] if out and out[-1].startswith("--") and "=" not in out[-1] else None
        if option and _NEGATIVE_WITH_UNIT.match(token):
            out[-1] = f"{option}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run ``kvcore`` with ``argv`` (default: the process's arguments); the exit code.

    A ``ValueError`` or ``TypeError`` from a command is printed as ``kvcore COMMAND: error: ...``
    (exit 2, like argparse's own), Ctrl-C as one ``...: interrupted`` line (exit 130); under
    ``--json`` every error, usage errors included, is a ``{"error": {"command", "type", "message"}}``
    object on stdout instead.
    """
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    json_errors = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
    asked = next((word for word in argv if not word.startswith("-")), None)
    args = None
    try:  # NOTE: parsing may import torch (an option's type): Ctrl-C there is an interruption too
        args = build_parser(json_errors=json_errors, load=asked).parse_args(argv)
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except (ValueError, TypeError) as exc:
        command = getattr(args, "command_name", f"kvcore {args.command}")
        if json_errors:
            _print_json_error(command, type(exc).__name__, str(exc))
        else:
            print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{getattr(args, 'command_name', 'kvcore')}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # NOTE: the reader left (`kvcore plan ... | head`): not an error of ours;
        # point stdout at devnull so Python's exit flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
