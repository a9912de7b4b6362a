"""Pure block-size arithmetic: choosing a common kernel block size, block-table widths.

Nothing here asks a hook; callers pass the sizes each backend declared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcore._validate import positive_int
from kvcore.memory.layout import split_ratio
from kvcore.specs import MultipleOf


def accepts(sizes: Sequence[int | MultipleOf], block_size: int) -> bool:
    """Whether a backend declaring ``sizes`` takes ``block_size``-token kernel blocks."""
    return any(s.accepts(block_size) if isinstance(s, MultipleOf) else s == block_size for s in sizes)


def fixed_sizes(sizes: Sequence[int | MultipleOf]) -> list[int]:
    """The explicit int sizes of a declaration."""
    return [s for s in sizes if not isinstance(s, MultipleOf)]


def pick_common_block_size(manager: int, offers: Sequence[tuple[str, Sequence[int | MultipleOf]]]) -> int:
    """The kernel block size shared by every ``(backend name, sizes)`` offer.

    The manager size itself when every offer accepts it; else the largest
    explicit int size of any offer that divides the manager size and every
    offer accepts (``MultipleOf`` answers never add candidates); else
    ``ValueError``. No offers: the manager size.
    """
    manager = positive_int("kv_manager_block_size", manager)
    sizes = [s for _, s in offers]
    if all(accepts(s, manager) for s in sizes):
        return manager
    candidates = {s for ss in sizes for s in fixed_sizes(ss) if manager % s == 0}
    for size in sorted(candidates, reverse=True):
        if all(accepts(s, size) for s in sizes):
            return size
    offered = "; ".join(f"{name}: {s}" for name, s in offers)
    raise ValueError(
        f"No common block size for {manager} ({offered}). Use a manager block size "
        "that every backend accepts or divides into a size they all accept."
    )


def get_block_table_width(
    max_num_blocks: int,
    block_size: int,
    kernel_block_size: int | None = None,
    *,
    token_alignment: int | None = 128,
) -> int:
    """Columns of a block table row, as vLLM sizes them.

    ``max_num_blocks`` manager blocks are rounded up so that a row covers a
    multiple of ``token_alignment`` tokens (None: no rounding), then
    multiplied by the split ratio ``block_size // kernel_block_size``:
    ``get_block_table_width(1875, 64) == 1876``, ``(5, 48) == 8``.
    """
    max_num_blocks = positive_int("max_num_blocks", max_num_blocks)
    block_size = positive_int("block_size", block_size)
    ratio = split_ratio(block_size, kernel_block_size)
    if token_alignment is not None:
        token_alignment = positive_int("token_alignment", token_alignment)
        unit = math.lcm(block_size, token_alignment) // block_size
        max_num_blocks = -(-max_num_blocks // unit) * unit
    return max_num_blocks * ratio
