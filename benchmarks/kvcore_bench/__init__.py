"""Micro-benchmarks behind ``kvcore bench <name>``.

Benchmark ``name`` is module ``kvcore_bench.<name>``: its options are in
:mod:`kvcore_bench.options` (no torch) and its ``run(args) -> int`` returns the
exit code. :mod:`kvcore_bench.cli` adds them to the ``kvcore`` command (entry point
group ``kvcore.cli``); modules that are not installed are left out.
"""

import argparse
import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvcore._table import Column, render
from kvcore_bench.options import ARGUMENTS

#: Benchmark name -> its module, in the order ``kvcore bench --help`` lists them.
BENCHMARKS: dict[str, str] = {name: f"{__name__}.{name}" for name in ARGUMENTS}


def emit(args: argparse.Namespace, result: object, print_text: Callable) -> None:
    """Write ``result`` to ``--json-out`` if given, then print it as JSON (``--json``) or text."""
    text = json.dumps(result, indent=2, default=str)
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_text(result)


def machine(device) -> str:
    """What a figure was measured on: the GPU's name, or the CPU's model and core count."""
    import os

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"CPU ({model or 'unknown model'}, {os.cpu_count()} cores)"


def fmt(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted by ``spec``; ``-`` for a value not measured."""
    return "-" if value is None else format(value, spec)


def table(title: str, spec: Sequence[tuple], rows: Sequence[dict], width: int | None = None,
          ) -> str:  # fmt: skip
    """Rows of dicts as a table; ``spec`` has one ``(header, key or cell function, fmt)`` per
    column: an empty ``fmt`` prints the value as text, left-aligned; any other is a
    :func:`format` spec of a number, right-aligned (``-`` where it is None)."""
    columns = [Column(header, right=bool(f)) for header, _, f in spec]
    cells = [[get(r) if callable(get) else r[get] for _, get, _ in spec] for r in rows]
    text = [[fmt(v, f) if f else str(v) for v, (_, _, f) in zip(row, spec)] for row in cells]
    return render(columns, text, title=title, width=width)


def _no_progress(total: int) -> Callable[[], None]:
    """``start`` without a progress bar: its ``tick`` does nothing."""
    return lambda: None


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int], Callable[[], object]]]:
    """``start(total) -> tick``: a progress bar on a terminal's stderr, erased when done (none
    without rich, or where stderr is not a terminal)."""
    try:
        from rich.console import Console
        from rich.progress import MofNCompleteColumn, Progress
    except ImportError:  # NOTE: a bare GPU machine may run kvcore from PYTHONPATH, without rich
        yield _no_progress
        return
    console = Console(stderr=True)
    if not console.is_terminal:  # NOTE: a bar in a log or a pipe is noise (and an empty line)
        yield _no_progress
        return
    columns = (*Progress.get_default_columns(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=True) as bar:

        def start(total: int) -> Callable[[], object]:
            """A task of ``total`` steps on the bar, and the function that advances it by one."""
            return functools.partial(bar.advance, bar.add_task(description, total=total))

        yield start
