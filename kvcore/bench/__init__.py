"""Micro-benchmarks behind ``kvcore bench <name>``.

Benchmark ``name`` is module ``kvcore.bench.<name>``: its options are in
:mod:`kvcore.bench.options` (no torch) and its ``run(args) -> int`` returns the
exit code. Modules that are not installed are left out of the command line.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from kvcore.bench.options import ARGUMENTS

#: Benchmark name -> its module, in the order ``kvcore bench --help`` lists them.
BENCHMARKS: dict[str, str] = {name: f"{__name__}.{name}" for name in ARGUMENTS}


def emit(args: argparse.Namespace, result: dict, print_text: Callable[[dict], object]) -> None:
    """Write ``result`` to ``--json-out`` if given, then print it as JSON (``--json``) or text."""
    text = json.dumps(result, indent=2, default=str)
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(text)
    if args.json:
        print(text)
    else:
        print_text(result)
