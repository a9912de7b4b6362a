"""Checks on the block ids handed to plans and transfers (before any byte moves)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from typing import Any

import torch


def plural(what: str) -> str:
    """``"block id of peer 'x'"`` -> ``"block ids of peer 'x'"``: the noun, not the name, takes the s."""
    noun, sep, rest = what.partition(" of ")
    return f"{noun}s{sep}{rest}"


def _refuse(value: Any, num_blocks: int, what: str, low: int) -> ValueError:
    return ValueError(
        f"{what} {value!r} is not an integer in [{low}, {num_blocks}); pass manager block "
        "ids from the block pool" + (" (block 0 is the null block and holds no data)" if low else "")
        + "; nothing was transferred"
    )


def block_id_tensor(block_ids: Any, num_blocks: int, *, what: str = "block id", null_ok: bool = True) -> torch.Tensor:
    """``block_ids`` (ints, a sequence of ints or an integer tensor) as a CPU int64 tensor.

    Every id must be an integer in ``[0, num_blocks)`` (``[1, num_blocks)``
    when ``null_ok`` is False), else ``ValueError``; bools are refused.
    """
    low = 0 if null_ok else 1
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype == torch.bool or block_ids.is_floating_point() or block_ids.is_complex():
            raise ValueError(f"{plural(what)} must be an integer tensor, got {block_ids.dtype}; pass int32/int64 ids")
        ids = block_ids.detach().reshape(-1).to("cpu", torch.int64)
        if ids.numel():
            bad = ids[(ids < low) | (ids >= num_blocks)]
            if bad.numel():
                raise _refuse(int(bad[0]), num_blocks, what, low)
        return ids
    if isinstance(block_ids, (str, bytes, Mapping, Set)) or block_ids is None:
        raise ValueError(
            f"{plural(what)} must be a sequence of integers (a list, tuple or integer tensor), got "
            f"{block_ids!r}; nothing was transferred"
        )
    if isinstance(block_ids, int) and not isinstance(block_ids, bool):
        block_ids = [block_ids]
    try:
        items = list(block_ids)
    except TypeError:
        raise _refuse(block_ids, num_blocks, what, low) from None
    values = []
    for value in items:
        if isinstance(value, bool) or "bool" in type(value).__name__:
            raise _refuse(value, num_blocks, what, low)
        try:
            value = operator.index(value)
        except TypeError:
            raise _refuse(value, num_blocks, what, low) from None
        if not low <= value < num_blocks:
            raise _refuse(value, num_blocks, what, low)
        values.append(value)
    return torch.tensor(values, dtype=torch.int64)


def _count(n: int, what: str) -> str:
    return what if n == 1 else plural(what)


def paired_ids(
    src_ids: Any, src_blocks: int, dst_ids: Any, dst_blocks: int, *, src_what: str, dst_what: str,
    src_null_ok: bool = False, dst_null_ok: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated source and destination ids of one transfer (one source per destination).

    Block 0 of a KV cache is the null block, refused unless ``*_null_ok``.
    """
    src = block_id_tensor(src_ids, src_blocks, what=src_what, null_ok=src_null_ok)
    dst = block_id_tensor(dst_ids, dst_blocks, what=dst_what, null_ok=dst_null_ok)
    if src.numel() != dst.numel():
        raise ValueError(
            f"got {src.numel()} {_count(src.numel(), src_what)} and {dst.numel()} "
            f"{_count(dst.numel(), dst_what)}; pass one "
            f"{dst_what} per {src_what} (nothing was transferred)"
        )
    if torch.unique(dst).numel() != dst.numel():
        values, counts = torch.unique(dst, return_counts=True)
        raise ValueError(
            f"{dst_what} {int(values[counts > 1][0])} is listed twice; each destination "
            "block takes one source block (nothing was transferred)"
        )
    return src, dst
