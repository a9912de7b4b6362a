"""argparse types of ``kvcore plan`` and the benchmarks, without torch (help comes back at once).

A type's error names the value and what is accepted.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvcore._units import parse_size

if TYPE_CHECKING:
    from kvcore.memory.layout import KVCacheLayout

# NOTE: KVCacheLayout's member names, so that help text needs no torch; a test checks they match.
LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def size_arg(text: str) -> int:
    """argparse type: a byte size such as ``40GiB`` (see :mod:`kvcore._units`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def layout_arg(text: str) -> KVCacheLayout:
    from kvcore.memory.layout import KVCacheLayout

    try:
        return KVCacheLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
