"""``kvcore bench``: run one micro-benchmark (``kvcore bench zero``, ``kvcore bench plan``, ...)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from pathlib import Path

from kvcore.bench import BENCHMARKS
from kvcore.cli._help import HelpFormatter, plain


def summary(module_name: str) -> str | None:
    """First line of a benchmark module's docstring, read without importing it; None if absent.

    ``"``kvcore bench zero``: the block zeroer ..."`` gives ``"the block zeroer ..."``.
    """
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    first = plain(doc).strip().splitlines()[0] if doc.strip() else module_name
    return first.split(": ", 1)[-1].rstrip(".")


def add_parser(subparsers: argparse._SubParsersAction, only: str | None = None) -> argparse.ArgumentParser:
    """Add ``bench`` and one sub-command per installed benchmark module.

    ``only`` names the one benchmark whose module is imported and whose
    options are added (None: all); the others are listed by name and summary.
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
        module = importlib.import_module(module_name)
        sub = benchmarks.add_parser(
            name, help=text, description=plain(module.__doc__), formatter_class=HelpFormatter
        )
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser
