"""Checks on the block ids handed to the zeroer.

A block id is an integer in ``[0, num_blocks)``: a Python ``int`` (or an
object with ``__index__`` that is not a bool), a 0-d integer tensor on the CPU,
a NumPy integer. Bools of every kind, floats, strings, mappings and tensors of
more than one element inside a list are refused before anything is written.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

#: The one element type of the fast path (``bool`` is a subclass of ``int``, not ``int``).
_PLAIN_INT = frozenset({int})


def _refuse(value: Any, num_blocks: int, why: str = "is not an integer") -> ValueError:
    return ValueError(
        f"block id {value!r} {why} in [0, {num_blocks}); pass manager block ids (ints) "
        "from the block pool (nothing was zeroed)"
    )


def _is_boolish(value: Any) -> bool:
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return isinstance(value, bool) or kind == "b" or "bool" in type(value).__name__.lower()


def _one_id(value: Any, num_blocks: int) -> int:
    """One element of an id list as an ``int`` (range checked by the caller)."""
    if _is_boolish(value):
        raise _refuse(value, num_blocks, "is a bool, not an integer")
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise _refuse(value, num_blocks, "is not a 0-d integer tensor")
        if value.device.type != "cpu":
            raise _refuse(value, num_blocks, "lives on the device (pass one device id tensor instead)")
        return int(value)
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kind is not None and kind not in "iu":
        raise _refuse(value, num_blocks)
    try:
        return operator.index(value)
    except TypeError:
        raise _refuse(value, num_blocks) from None


def id_list(values: list | tuple, num_blocks: int) -> list[int]:
    """A list or tuple of ids as a list of ints in ``[0, num_blocks)`` (plain ints checked in bulk)."""
    if _PLAIN_INT.issuperset(map(type, values)):
        ints = values if isinstance(values, list) else list(values)
    else:
        ints = [_one_id(v, num_blocks) for v in values]
    if ints and (min(ints) < 0 or max(ints) >= num_blocks):
        raise _refuse(next(v for v in ints if not 0 <= v < num_blocks), num_blocks, "is not")
    return ints


def host_tensor(ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A CPU integer tensor of any shape as a flat int64 tensor, range checked."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"block id tensor has dtype {ids.dtype}, not an integer dtype; pass int32/int64 ids (nothing was zeroed)"
        )
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel():
        for bound in (int(flat.min()), int(flat.max())):
            if not 0 <= bound < num_blocks:
                raise _refuse(bound, num_blocks, "is not")
    return flat


def host_ids(block_ids: Any, num_blocks: int) -> list[int] | torch.Tensor:
    """Any host form of ids as a checked list of ints or a flat CPU int64 tensor.

    Accepts one integer, a list/tuple/iterable of integers, a CPU integer
    tensor or a NumPy integer array; ``TypeError`` for a mapping (its keys are
    no block ids), ``ValueError`` for everything else.
    """
    if isinstance(block_ids, torch.Tensor):
        return host_tensor(block_ids, num_blocks)
    if isinstance(block_ids, (list, tuple)):
        return id_list(block_ids, num_blocks)
    if isinstance(block_ids, Mapping):
        raise TypeError(
            f"block ids must be integers or a sequence of them, got a {type(block_ids).__name__}; "
            "pass list(mapping.values()) (or its keys) if those are the manager block ids"
        )
    if _is_boolish(block_ids):
        raise _refuse(block_ids, num_blocks, "is a bool, not an integer")
    if isinstance(block_ids, (str, bytes, float)) or block_ids is None:
        raise _refuse(block_ids, num_blocks)
    kind = getattr(getattr(block_ids, "dtype", None), "kind", None)
    if kind is not None and getattr(block_ids, "ndim", 0):
        # NOTE: a NumPy array (or alike): integer dtypes only, then as a tensor.
        if kind not in "iu":
            raise _refuse(block_ids, num_blocks, f"array has dtype {block_ids.dtype}, not an integer dtype;")
        return host_tensor(torch.as_tensor(block_ids.astype("int64")), num_blocks)
    if hasattr(block_ids, "__index__"):
        return id_list([block_ids], num_blocks)
    try:
        values = list(block_ids)
    except TypeError:
        raise _refuse(block_ids, num_blocks) from None
    return id_list(values, num_blocks)


def device_ids(block_ids: torch.Tensor, device: torch.device, num_blocks: int, validate: bool) -> torch.Tensor:
    """A device id tensor as a contiguous 1-D int32/int64 tensor, without a host sync.

    ``validate=True`` checks the range on the host (one sync); otherwise the kernel skips ids out of range.
    """
    if block_ids.device != device:
        raise ValueError(f"block ids live on {block_ids.device}, the caches on {device}; move the ids there")
    if block_ids.dtype == torch.bool or block_ids.is_floating_point() or block_ids.is_complex():
        raise ValueError(f"block id tensor has dtype {block_ids.dtype}, not an integer dtype; pass int32/int64 ids")
    ids = block_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    if validate and ids.numel():
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        if bad.numel():
            raise _refuse(int(bad[0]), num_blocks, "is not")
    return ids.contiguous()
