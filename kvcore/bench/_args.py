"""argparse types shared by the benchmarks and the ``kvcore`` command line.

They sit here, below ``kvcore.cli``, so that benchmarks never import the
command line. Each type raises ``argparse.ArgumentTypeError`` with a message
that names the value and what is accepted; argparse adds the option's name.
"""

from __future__ import annotations

import argparse

from typing import TYPE_CHECKING

from kvcore._units import parse_size

if TYPE_CHECKING:
    import torch

    from kvcore.memory.layout import KVCacheLayout

# NOTE: the names of KVCacheLayout's members, kept here so that help text needs
# no torch (kvcore.memory imports it); a test checks they match the enum.
LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


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
    from kvcore.memory.layout import KVCacheLayout

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
    return ", ".join(LAYOUT_NAMES)


def device_arg(text: str) -> torch.device:
    """argparse type: a torch device this machine has, ``cpu`` or ``cuda[:N]``.

    ``banana``, ``cuda`` without a GPU and ``cuda:3`` on a one-GPU machine are
    usage errors (exit 2) that say which devices there are.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(
            f"{text!r}: kvcore runs on 'cpu' or 'cuda[:N]' devices, not {device.type!r}"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device; use --device cpu")
    if device.index is not None and device.index >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA device{'s' * (count > 1)} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); pick one of them"
        )
    return device
