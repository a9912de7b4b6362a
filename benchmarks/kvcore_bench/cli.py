"""``kvcore bench``: the sub-command this distribution adds to ``kvcore`` (entry point group
``kvcore.cli``), built without torch so that help and usage errors come back at once."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import shutil
import textwrap
import tokenize

from kvcore_bench import BENCHMARKS
from kvcore_bench.options import ARGUMENTS


def _lazy(module_name: str):
    """``module_name.run``, importing the module (torch and all) only when called."""
    return lambda args: importlib.import_module(module_name).run(args)


def _docstring(module_name: str) -> str | None:
    """A benchmark module's docstring as help text, read without importing it; None if absent."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    # NOTE: only the first string token, not the whole module (help comes back at once).
    with open(spec.origin, encoding="utf-8") as source:
        tokens = tokenize.generate_tokens(source.readline)
        first = next(t.string for t in tokens if t.type == tokenize.STRING)
    return ast.literal_eval(first).strip().replace("``", "")


def add_command(commands: argparse._SubParsersAction) -> None:
    """Add ``kvcore bench BENCHMARK`` to ``commands`` (the ``kvcore`` sub-parsers)."""
    bench = commands.add_parser(
        "bench", help="run a micro-benchmark",
        description="kvcore bench: run one micro-benchmark (kvcore bench zero, kvcore bench plan, "
        "...).")
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        doc = _docstring(module_name)
        if doc is None:  # not installed
            continue
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        summary = paragraphs[0].split(": ", 1)[-1].rstrip(".")
        # NOTE: paragraphs kept, each filled to the terminal (argparse's own width), at most 80
        width = min(shutil.get_terminal_size().columns, 80) - 2
        description = "\n\n".join(textwrap.fill(p, width, break_on_hyphens=False) for p in paragraphs)
        one = benchmarks.add_parser(name, help=summary, description=description,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        ARGUMENTS[name](one)
        one.set_defaults(func=_lazy(module_name), command_name=f"kvcore bench {name}")
