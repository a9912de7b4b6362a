"""Checks on the block ids handed to the zeroer."""

from __future__ import annotations

import operator
from typing import Any

import torch


def _refuse(value: Any, num_blocks: int) -> ValueError:
    return ValueError(
        f"block id {value!r} is not an integer in [0, {num_blocks}); pass manager block "
        "ids from the block pool (nothing was zeroed)"
    )


def host_ids(block_ids: Any, num_blocks: int) -> torch.Tensor:
    """``block_ids`` (an int, a sequence of ints or a CPU integer tensor) as a CPU int64 tensor.

    Every id must be an integer in ``[0, num_blocks)``, else ``ValueError``.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype == torch.bool or block_ids.is_floating_point() or block_ids.is_complex():
            raise ValueError(
                f"block ids must be an integer tensor, got {block_ids.dtype}; pass int32/int64 ids"
            )
        flat = block_ids.reshape(-1).to(torch.int64)
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0:
                raise _refuse(low, num_blocks)
            if high >= num_blocks:
                raise _refuse(high, num_blocks)
        return flat.contiguous()
    if isinstance(block_ids, (str, bytes)) or block_ids is None:
        raise ValueError(f"block ids must be integers, got {block_ids!r}")
    if not isinstance(block_ids, (list, tuple)):
        try:
            block_ids = [block_ids] if not hasattr(block_ids, "__iter__") else list(block_ids)
        except TypeError:
            raise _refuse(block_ids, num_blocks) from None
    values = []
    for value in block_ids:
        if type(value) is not int:
            if isinstance(value, bool) or "bool" in type(value).__name__:
                raise _refuse(value, num_blocks)
            try:
                value = operator.index(value)
            except TypeError:
                raise _refuse(value, num_blocks) from None
        if not 0 <= value < num_blocks:
            raise _refuse(value, num_blocks)
        values.append(value)
    return torch.tensor(values, dtype=torch.int64)


def device_ids(block_ids: torch.Tensor, device: torch.device, num_blocks: int, validate: bool) -> torch.Tensor:
    """A device id tensor as a contiguous 1-D int32/int64 tensor, without a host sync.

    ``validate=True`` checks the range on the host (one sync); otherwise ids
    out of range are left for the kernel, which skips them.
    """
    if block_ids.device != device:
        raise ValueError(
            f"block ids live on {block_ids.device}, the caches on {device}; move the ids there"
        )
    if block_ids.dtype == torch.bool or block_ids.is_floating_point() or block_ids.is_complex():
        raise ValueError(f"block ids must be an integer tensor, got {block_ids.dtype}; pass int32/int64 ids")
    ids = block_ids.reshape(-1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    if validate and ids.numel():
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        if bad.numel():
            raise _refuse(int(bad[0]), num_blocks)
    return ids.contiguous()
