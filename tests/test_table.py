"""Plain-text tables: fit the width when words allow, never cut or break a word."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore._table import Column, render

WORD = st.text("abcdefghij0123456789-,.%", min_size=1, max_size=12)
CELL = st.lists(WORD, min_size=1, max_size=6).map(" ".join)


@st.composite
def tables(draw):
    ncols = draw(st.integers(1, 6))
    columns = [Column(draw(CELL), right=draw(st.booleans()), wrap=draw(st.booleans())) for _ in range(ncols)]
    rows = draw(st.lists(st.lists(CELL, min_size=ncols, max_size=ncols), max_size=5))
    return columns, rows, draw(st.integers(10, 120))


def _floor(columns, rows):
    """The narrowest width the table may take: no word is broken."""
    widths = []
    for i, col in enumerate(columns):
        words = [len(w) for w in col.header.split()]
        for row in rows:
            words += [len(w) for w in row[i].split()] if col.wrap else [len(row[i])]
        widths.append(max(words))
    return sum(widths) + 2 * (len(columns) - 1)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(tables())
def test_every_word_survives_and_the_table_fits_when_it_can(table):
    columns, rows, width = table
    text = render(columns, rows, title="a title", width=width)
    printed = text.split()
    for cell in [c.header for c in columns] + [cell for row in rows for cell in row]:
        for word in cell.split():
            assert word in printed, (word, text)
    assert "…" not in text
    if _floor(columns, rows) <= width:
        assert all(len(line) <= width for line in text.splitlines()), text


def test_numbers_align_right_and_cells_wrap_between_words():
    columns = [Column("group", right=True), Column("layer indices", wrap=True)]
    rows = [["7", "0-4, 6-10, 12-16, 18-22"], ["12", "5"]]
    assert render(columns, rows, width=20).splitlines() == [
        "group  layer indices",
        "-----  -------------",
        "    7  0-4, 6-10,",
        "       12-16, 18-22",
        "   12  5",
    ]
    # Narrower: the header wraps too, bottom-aligned; no word is broken.
    assert render(columns, rows, width=14).splitlines()[:4] == [
        "       layer", "group  indices", "-----  -------", "    7  0-4,"
    ]


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        render([Column("a")], [["x", "y"]])
