"""Plain-text tables that never cut a value (too wide for the terminal, headers wrap between words,
then wrappable cells; else the table is printed wider), and index lists as ranges."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence
from typing import NamedTuple

GAP = "  "


class Column(NamedTuple):
    """A column: its header, whether cells align right (numbers), whether cells may wrap."""

    header: str
    right: bool = False
    wrap: bool = False


def terminal_width() -> int:
    """Columns of the terminal; 80 when output is piped (``COLUMNS`` overrides both)."""
    return shutil.get_terminal_size((80, 24)).columns


def format_ranges(indices: list[int]) -> str:
    """Sorted ``indices`` as ranges: ``[0, 1, 2, 5]`` is ``0-2, 5``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _longest_word(text: str) -> int:
    return max(map(len, text.split()), default=0)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]


def _widths(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    cells = [max((len(r[i]) for r in rows), default=0) for i in range(len(columns))]
    widths = [max(c, len(col.header)) for c, col in zip(cells, columns)]
    # NOTE: two floors, tried in turn: headers wrapped to their longest word,
    # then wrappable cells wrapped to their longest word too. Never below a word.
    header_floors = [max(c, _longest_word(col.header)) for c, col in zip(cells, columns)]
    words = [max((_longest_word(r[i]) for r in rows), default=0) for i in range(len(columns))]
    cell_floors = [
        max(w, _longest_word(col.header)) if col.wrap else floor
        for w, col, floor in zip(words, columns, header_floors)
    ]
    for floors in (header_floors, cell_floors):
        for i in sorted(range(len(columns)), key=lambda i: floors[i] - widths[i]):
            excess = sum(widths) + len(GAP) * (len(columns) - 1) - width
            if excess <= 0:
                return widths
            widths[i] = max(floors[i], widths[i] - excess)
    return widths


def render(columns: Sequence[Column], rows: Sequence[Sequence[str]], *, title: str | None = None,
           width: int | None = None) -> str:
    """The table as text (no trailing newline); ``width`` defaults to the terminal's."""
    width = terminal_width() if width is None else width
    rows = [[str(cell) for cell in row] for row in rows]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row has {len(row)} cells for {len(columns)} columns: {row}")
    widths = _widths(columns, rows, width)
    lines = _wrap(title, max(width, 20)) if title else []

    def emit(cells: list[list[str]], bottom: bool) -> None:
        height = max(len(c) for c in cells)
        for k in range(height):
            parts = []
            for col, w, c in zip(columns, widths, cells):
                c = [""] * (height - len(c)) + c if bottom else c + [""] * (height - len(c))
                parts.append(c[k].rjust(w) if col.right else c[k].ljust(w))
            lines.append(GAP.join(parts).rstrip())

    emit([_wrap(col.header, w) for col, w in zip(columns, widths)], bottom=True)
    lines.append(GAP.join("-" * w for w in widths))
    for row in rows:
        emit([_wrap(cell, w) if col.wrap else [cell] for col, w, cell in zip(columns, widths, row)], bottom=False)
    return "\n".join(lines)
