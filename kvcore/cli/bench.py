"""``kvcore bench``: run one micro-benchmark (``kvcore bench zero``, ``kvcore bench plan``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from kvcore.bench import BENCHMARKS
from kvcore.cli._args import plain


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` and one sub-command per installed benchmark module."""
    parser = subparsers.add_parser("bench", help="run a micro-benchmark", description=plain(__doc__))
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        summary = plain(module.__doc__ or name).strip().splitlines()[0].split(": ", 1)[-1]
        sub = benchmarks.add_parser(
            name, help=summary, description=plain(module.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser
