"""The ``kvcore`` command line: ``kvcore plugins``, ``kvcore plan``, ``kvcore bench``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# sub-command -> module defining ``add_parser(subparsers)``; each parser sets
# ``func`` (a callable taking the parsed args and returning an exit code).
_COMMANDS = {
    "plugins": "kvcore.cli.plugins",
    "plan": "kvcore.cli.plan",
    "bench": "kvcore.cli.bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description=__doc__.replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in _COMMANDS.values():
        if importlib.util.find_spec(module_name) is not None:
            importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as exc:
        print(f"kvcore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
