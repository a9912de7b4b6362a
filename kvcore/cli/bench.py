"""``kvcore bench``: run one micro-benchmark (``kvcore bench zero``, ``kvcore bench plan``, ...)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from kvcore.bench import BENCHMARKS
from kvcore.bench.options import ARGUMENTS
from kvcore.cli._help import HelpFormatter, plain


def docstring(module_name: str) -> str | None:
    """A benchmark module's docstring, read without importing it; None if not installed."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""


def summary(module_name: str) -> str | None:
    """First line of a benchmark module's docstring, read without importing it; None if absent.

    ``"``kvcore bench zero``: the block zeroer ..."`` gives ``"the block zeroer ..."``.
    """
    doc = docstring(module_name)
    if doc is None:
        return None
    first = plain(doc).strip().splitlines()[0] if doc.strip() else module_name
    return first.split(": ", 1)[-1].rstrip(".")


def _runner(module_name: str) -> Callable[[argparse.Namespace], int]:
    """The benchmark's ``run``, importing its module (torch and all) only when called."""

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module_name).run(args)

    return run


def add_parser(subparsers: argparse._SubParsersAction, only: str | None = None) -> argparse.ArgumentParser:
    """Add ``bench`` and one sub-command per installed benchmark module.

    ``only`` names the one benchmark whose options are added (None: all); the
    others are listed by name and summary. A benchmark module is imported when
    it runs, or, for one without options in :mod:`kvcore.bench.options`, to add
    its options.
    """
    parser = subparsers.add_parser("bench", help="run a micro-benchmark", description=plain(__doc__))
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        text = summary(module_name)
        if text is None:  # not installed
            continue
        if only is not None and name != only:
            benchmarks.add_parser(name, help=text)
            continue
        sub = benchmarks.add_parser(
            name, help=text, description=plain(docstring(module_name)), formatter_class=HelpFormatter
        )
        if name in ARGUMENTS:  # NOTE: options defined without torch: help comes back at once
            ARGUMENTS[name](sub)
            sub.set_defaults(func=_runner(module_name))
        else:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(func=module.run)
    return parser
