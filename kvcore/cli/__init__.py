"""The kvcore command line: plan a model's KV cache, list presets and plugins, benchmark.

Only the module of the sub-command being run is imported, so ``kvcore --help``
and ``kvcore --version`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys

from kvcore import __version__

# NOTE: name -> (module defining add_parser(subparsers), one-line help). The
# help is here so that `kvcore --help` lists every command without importing
# any; tests check it matches what each module registers.
_COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvcore.cli.plan", "plan a model's KV cache for a memory budget"),
    "models": ("kvcore.cli.model_presets", "list the model presets that kvcore plan knows"),
    "plugins": ("kvcore.cli.plugins", "list and health-check installed kvcore plugins"),
    "bench": ("kvcore.cli.bench", "run a micro-benchmark"),
    "completion": ("kvcore.cli.completion", "print a shell completion script (bash, zsh, tcsh)"),
}
_EPILOG = "Run 'kvcore COMMAND --help' for the options of one command."
# A value such as -5GiB: argparse would take it for an option (see _attach_negative_values).
_NEGATIVE_WITH_UNIT = re.compile(r"^-[0-9.]+\s*[A-Za-z]+$")


class _JsonErrorParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are a JSON object on stdout (exit 2), for ``--json``.

    Sub-command parsers are of the same class (argparse makes them so).
    """

    def error(self, message: str):  # type: ignore[override]
        _print_json_error(self.prog, "usage", message)
        self.exit(2)


def _print_json_error(command: str, kind: str, message: str) -> None:
    """The error object ``--json`` prints instead of output: ``{"error": {...}}``."""
    error = {"command": command, "type": kind, "message": message}
    print(json.dumps({"error": error}, indent=2))
    sys.stdout.flush()


def _positionals(argv: list[str]) -> list[str]:
    return [token for token in argv if not token.startswith("-")]


def build_parser(argv: list[str] | None = None, *, json_errors: bool = False) -> argparse.ArgumentParser:
    """The ``kvcore`` parser.

    With ``argv``, only the sub-command it names gets its arguments (and its
    module imported); the others are listed by name and help. Without, every
    sub-command is complete. ``json_errors``: usage errors as JSON objects.
    """
    parser_class = _JsonErrorParser if json_errors else argparse.ArgumentParser
    parser = parser_class(prog="kvcore", description=__doc__.splitlines()[0], epilog=_EPILOG)
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    words = None if argv is None else _positionals(argv)
    for name, (module_name, summary) in _COMMANDS.items():
        if words is not None and words[:1] != [name]:
            sub.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        if name == "bench":
            # NOTE: benchmarks are loaded lazily too (their modules import torch,
            # or transformers): only the one named after "bench" is imported.
            module.add_parser(sub, only=None if words is None else (words[1:2] or [""])[0])
        else:
            module.add_parser(sub)
    return parser


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--memory -5GiB`` as ``--memory=-5GiB``.

    argparse reads a lone token that starts with ``-`` and is not a plain
    number as an option, and would answer "expected one argument"; attached,
    the value reaches its type, which says what is wrong with it.
    """
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        if _NEGATIVE_WITH_UNIT.match(token) and previous.startswith("--") and "=" not in previous:
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run ``kvcore`` with ``argv`` (default: the process's arguments); the exit code.

    A ``ValueError`` or ``TypeError`` from a command is a user error: printed
    as ``kvcore COMMAND: error: ...`` with exit code 2, like argparse's own.
    Under ``--json`` every error, usage errors included, is printed on stdout
    as ``{"error": {"command", "type", "message"}}`` instead (exit code 2).
    """
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    # NOTE: with --json anywhere, errors come back as a JSON object on stdout, usage errors too.
    json_errors = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
    args = build_parser(argv, json_errors=json_errors).parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except (ValueError, TypeError) as exc:
        command = " ".join(filter(None, ("kvcore", args.command, getattr(args, "benchmark", None))))
        if getattr(args, "json", False):
            _print_json_error(command, type(exc).__name__, str(exc))
        else:
            print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # NOTE: the reader left (`kvcore plan ... | head`): not an error of ours;
        # point stdout at devnull so Python's exit flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
