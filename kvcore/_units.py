"""Byte sizes as people write and read them: ``40GiB`` in, ``1.25 MiB`` out (units below)."""

from __future__ import annotations

import re
from fractions import Fraction

#: Which units mean what (also the command-line help).
SIZE_UNITS_HELP = ("K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024 (40G = 40GiB); "
                   "KB/MB/GB/TB are powers of 1000 (40GB = 40 x 10^9 bytes, about 37.25 GiB)")

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([+-]?)\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``40GiB``, ``512MB``, ``1.5G``, a byte count), a fraction of a byte
    dropped; ``ValueError`` naming the text for anything else or below one byte."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group(3).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: use a byte count or a number with "
                         f"a unit, such as 40GiB, 512MiB or 80GB ({SIZE_UNITS_HELP})")
    value = int(Fraction(match.group(2)) * _UNITS[unit])
    if match.group(1) == "-" or value <= 0:
        raise ValueError(f"invalid size {text!r}: a size must be at least one byte, such as 40GiB")
    return value


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit up to TiB that keeps it at least 1, two decimals at
    most, trailing zeros dropped (``1.25 MiB``, ``40 GiB``, ``512 B``)."""
    for unit, scale in _BINARY:
        if abs(n) >= scale:
            return f"{n / scale:,.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n:,} B"


def format_bytes_exact(n: int) -> str:
    """The human form with the exact count beside it: ``1.25 MiB (1,310,720 bytes)``."""
    human = format_bytes(n)
    return human if abs(n) < 1024 else f"{human} ({n:,} bytes)"
