"""What the zeroer is given, checked: layer views (or the seed's arguments) and block ids, refused
before anything is written (docs/zeroer.md lists what a block id may be)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.runtime.attn_group import flatten_attention_groups

_PLAIN_INT = frozenset({int})  # NOTE: the fast path's one element type (bool is no int here)


def _refuse(value: Any, num_blocks: int, why: str = "is not an integer") -> ValueError:
    return ValueError(f"block id {value!r} {why} in [0, {num_blocks}); pass manager block ids (ints) "
                      "from the block pool (nothing was zeroed)")


def _one_id(value: Any, num_blocks: int) -> int:
    """One element of an id list as an ``int`` (range checked by the caller)."""
    if isinstance(value, torch.Tensor):
        if value.dim() or value.device.type != "cpu" or not _integer_dtype(value.dtype):
            raise _refuse(value, num_blocks, "is not a 0-d integer CPU tensor (pass one id tensor instead)")
        return int(value)
    kind = getattr(getattr(value, "dtype", None), "kind", "i")
    if isinstance(value, bool) or kind not in "iu":
        raise _refuse(value, num_blocks)
    try:
        return operator.index(value)
    except TypeError:
        raise _refuse(value, num_blocks) from None


def _integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def id_list(values: list | tuple, num_blocks: int) -> list[int]:
    """A list or tuple of ids as a list of ints in ``[0, num_blocks)`` (plain ints checked in bulk)."""
    if _PLAIN_INT.issuperset(map(type, values)):
        ints = values if isinstance(values, list) else list(values)
    else:
        ints = [_one_id(v, num_blocks) for v in values]
    if ints and (min(ints) < 0 or max(ints) >= num_blocks):
        raise _refuse(next(v for v in ints if not 0 <= v < num_blocks), num_blocks, "is not")
    return ints


def host_ids(block_ids: Any, num_blocks: int) -> list[int] | torch.Tensor:
    """Any host form of ids as a checked list of ints or a flat CPU int64 tensor."""
    if isinstance(block_ids, Mapping):
        raise TypeError(f"block ids must be integers or a sequence of them, got a {type(block_ids).__name__}; "
                        "pass list(mapping.values()) (or its keys) if those are the manager block ids")
    if isinstance(block_ids, torch.Tensor) or getattr(block_ids, "ndim", 0):
        return tensor_ids(torch.as_tensor(block_ids), num_blocks, True)  # NOTE: or a NumPy array (ndim >= 1)
    if isinstance(block_ids, (str, bytes)) or hasattr(block_ids, "__index__") or not hasattr(block_ids, "__iter__"):
        return id_list([block_ids], num_blocks)  # NOTE: one id (or one thing that is none)
    return id_list(block_ids if isinstance(block_ids, (list, tuple)) else list(block_ids), num_blocks)


def tensor_ids(ids: torch.Tensor, num_blocks: int, check: bool) -> torch.Tensor:
    """An integer tensor of ids as a flat contiguous int32/int64 tensor; ``check``: range checked (a sync on GPUs)."""
    if not _integer_dtype(ids.dtype):
        raise ValueError(f"block id tensor has dtype {ids.dtype}, not an integer dtype; pass int32/int64 ids "
                         "(nothing was zeroed)")
    flat = ids.reshape(-1)
    flat = (flat if flat.dtype in (torch.int32, torch.int64) else flat.to(torch.int64)).contiguous()
    for bound in (int(flat.min()), int(flat.max())) if check and flat.numel() else ():
        if not 0 <= bound < num_blocks:
            raise _refuse(bound, num_blocks, "is not")
    return flat


def views_of_groups(attn_groups: Iterable[Any], kernel_block_sizes: list[int | None],
                    kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                    runner_only_attn_layers: Iterable[str] | None = None) -> dict[str, tuple[torch.Tensor, int]]:
    """The views of ``attn_groups``' layers (packed kernel-block views mapped back to manager blocks),
    but runner-only ones, missing ones and specs without layer views."""
    skip = set(runner_only_attn_layers or ())
    views: dict[str, tuple[torch.Tensor, int]] = {}
    for group in flatten_attention_groups(attn_groups):
        if not group.kv_cache_spec.has_layer_views:
            continue
        block_size, kernel = group.kv_cache_spec.block_size, group.kernel_block_size
        if kernel is None and group.kv_cache_group_id < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group.kv_cache_group_id]
        kernel = block_size if kernel is None else positive_int("kernel block size", kernel)
        if block_size % kernel:
            raise ValueError(f"group {group.kv_cache_group_id}: block size {block_size} is not divisible by kernel "
                             f"block size {kernel}; pass kernel_block_sizes that divide the block sizes")
        ratio = block_size // kernel
        for name in group.layer_names:
            view = kv_caches.get(name)
            if name in skip or not isinstance(view, torch.Tensor):
                continue
            if group.kernel_block_stride:  # NOTE: a packed kernel-block view
                views[name] = (group.map_kv_cache_to_manager_blocks(view, num_blocks), 1)
            elif view.shape[0] in (num_blocks, num_blocks * ratio) or (ratio == 1 and view.shape[0] > num_blocks):
                views[name] = (view, ratio if view.shape[0] == num_blocks * ratio else 1)
            else:
                raise ValueError(f"layer {name!r} has {view.shape[0]} rows, neither {num_blocks} manager blocks nor "
                                 f"{num_blocks * ratio} kernel blocks; pass the num_blocks and kernel_block_sizes "
                                 "the caches were allocated with")
    return views


def checked_views(views: Any, num_blocks: int) -> dict[str, tuple[torch.Tensor, int]]:
    """The ``views`` of ``KVBlockZeroer.from_views`` (layer -> ``(view, rows_per_block)``), checked."""
    if not isinstance(views, Mapping):
        raise TypeError(f"views must map layer names to (view, rows_per_block), got {type(views).__name__}")
    out = {}
    for name, entry in views.items():
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
            raise TypeError(f"views[{name!r}] must be a (tensor view, rows_per_block) pair, got {type(entry).__name__}")
        view, rows = entry[0], positive_int(f"rows_per_block of layer {name!r}", entry[1])
        if view.dim() < 2:
            raise ValueError(f"layer {name!r}: a {view.dim()}-D tensor is no layer view [blocks, ...]; pass the views "
                             "allocate_kv_cache makes (raw buffers cannot be zeroed by block)")
        if view.shape[0] != num_blocks * rows:
            raise ValueError(f"layer {name!r} has {view.shape[0]} rows, not num_blocks * rows_per_block = "
                             f"{num_blocks} * {rows}; pass the views as allocated with their split ratio")
        out[name] = (view, rows)
    return out
