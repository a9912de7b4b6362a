"""Byte sizes in and out: ``40GiB`` vs ``40GB``, and human units that never read ``102400.00 GiB``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore._units import format_bytes, format_bytes_exact, parse_size

GIB = 1 << 30


@pytest.mark.parametrize(
    "text, value",
    [("40GiB", 40 * GIB), ("40G", 40 * GIB), ("40GB", 40 * 10**9), ("512MiB", 512 << 20),
     ("1.5G", 3 * GIB // 2), ("4096", 4096), ("2 kib", 2048), ("1T", 1 << 40), ("1.3G", 1395864371)],
)
def test_parse_size_binary_and_decimal_units(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text, match", [
    ("12XB", "invalid size '12XB'.*40GiB"), ("lots", "invalid size"), ("-5GiB", "at least one byte"),
    ("0", "at least one byte"), ("0.5B", "at least one byte"), ("", "invalid size"),
])  # fmt: skip
def test_parse_size_rejects_with_the_text_and_the_units(text, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [(512, "512 B"), (1024, "1 KiB"), (573_440, "560 KiB"), (1_310_720, "1.25 MiB"), (40 * GIB, "40 GiB"),
     (100 << 40, "100 TiB"), (102_400 << 30, "100 TiB"), (5000 << 40, "5,000 TiB")],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(min_value=1, max_value=1 << 56))
def test_format_bytes_round_trips_within_rounding(n):
    """The printed form parses back to within half a unit of the last printed digit."""
    text = format_bytes(n)
    number, unit = text.split(" ")
    assert 1 <= float(number.replace(",", "")) < 1024 or unit in ("TiB", "B")
    back = parse_size(number.replace(",", "") + unit)
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
    assert abs(back - n) <= scale * 0.005 + 1
    assert format_bytes_exact(n).startswith(text)
    if n >= 1024:
        assert format_bytes_exact(n).endswith(f"({n:,} bytes)")
