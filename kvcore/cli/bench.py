"""``kvcore bench``: run one micro-benchmark (``kvcore bench zero``, ``kvcore bench plan``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from kvcore.bench import BENCHMARKS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` and one sub-command per installed benchmark module."""
    parser = subparsers.add_parser("bench", help="run a micro-benchmark", description=__doc__)
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or name).strip().splitlines()[0]
        sub = benchmarks.add_parser(
            name, help=summary, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
    return parser
