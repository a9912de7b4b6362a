"""argparse types shared by the benchmarks and the ``kvcore`` command line.

They sit here, below ``kvcore.cli``, so that benchmarks never import the
command line. Each type raises ``argparse.ArgumentTypeError`` with a message
that names the value and what is accepted; argparse adds the option's name.
"""

from __future__ import annotations

import argparse

from kvcore._units import parse_size
from kvcore.memory.layout import KVCacheLayout


def size_arg(text: str) -> int:
    """argparse type: a byte size such as ``40GiB`` (see :mod:`kvcore._units`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int_arg(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_ints_arg(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``1,8,64``)."""
    values = [positive_int_arg(v.strip()) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def layout_arg(text: str) -> KVCacheLayout:
    """argparse type: one layout name; the error lists the valid names."""
    try:
        return KVCacheLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layouts_arg(text: str) -> list[KVCacheLayout]:
    """argparse type: comma-separated layout names."""
    layouts = [layout_arg(v.strip()) for v in text.split(",") if v.strip()]
    if not layouts:
        raise argparse.ArgumentTypeError(f"expected comma-separated layout names, got {text!r}")
    return layouts


def layout_names() -> str:
    """The layout names, for help text."""
    return ", ".join(layout.name for layout in KVCacheLayout)
