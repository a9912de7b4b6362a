"""What the examples share at their command line: a ``--device`` this machine has, and one line
for a bad argument (exit 2, as argparse) or for Ctrl-C (exit 130), never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (exit 2): the message and where help is."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def device_arg(text: str) -> torch.device:
    """argparse type: ``cpu`` or ``cuda[:N]`` of this machine."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the examples run on 'cpu' or 'cuda[:N]'")
    if device.type == "cuda" and (device.index or 0) >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {have}; use --device cpu")
    return device


def run(main: Callable[[], object], name: str) -> None:
    """Exit with ``main()``'s status (an int; anything else is 0): a refused value or request
    (``ValueError``, ``TypeError``) exits 2 with one line, Ctrl-C 130 with one line."""
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except (ValueError, TypeError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
