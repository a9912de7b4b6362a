"""The zeroer's input as ``{layer: (view, rows per manager block)}``, checked.

``KVBlockZeroer.from_views`` takes that form directly (``checked_view``); the
seed's arguments (attention groups + kernel block sizes) are translated to it
by ``views_of_groups``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.runtime.attn_group import flatten_attention_groups


def views_of_groups(
    attn_groups: Iterable[Any],
    kernel_block_sizes: list[int | None],
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    runner_only_attn_layers: Iterable[str] | None = None,
) -> dict[str, tuple[torch.Tensor, int]]:
    """``{layer: (view, rows per manager block)}`` for every zeroable layer of ``attn_groups``.

    Runner-only layers, layers without a tensor and specs without layer views
    are skipped; a packed kernel-block view is mapped back to manager blocks.
    """
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
            raise ValueError(
                f"group {group.kv_cache_group_id}: block size {block_size} is not divisible by "
                f"kernel block size {kernel}; pass kernel_block_sizes that divide the block sizes"
            )
        ratio = block_size // kernel
        for name in group.layer_names:
            view = kv_caches.get(name)
            if name in skip or not isinstance(view, torch.Tensor):
                continue
            if group.kernel_block_stride:
                # NOTE: packed kernel-block views: zero by manager block instead.
                views[name] = (group.map_kv_cache_to_manager_blocks(view, num_blocks), 1)
            elif view.shape[0] == num_blocks * ratio or (ratio > 1 and view.shape[0] == num_blocks):
                views[name] = (view, view.shape[0] // num_blocks)
            elif ratio == 1 and view.shape[0] > num_blocks:
                views[name] = (view, 1)  # NOTE: a view of more blocks than zeroed
            else:
                raise ValueError(
                    f"layer {name!r} has {view.shape[0]} rows, neither {num_blocks} manager blocks nor "
                    f"{num_blocks * ratio} kernel blocks; pass the num_blocks and "
                    "kernel_block_sizes the caches were allocated with"
                )
    return views


def checked_view(name: Any, entry: Any, num_blocks: int) -> tuple[torch.Tensor, int]:
    """One ``(view, rows_per_block)`` entry of ``KVBlockZeroer.from_views``, checked."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
        raise TypeError(
            f"views[{name!r}] must be a (tensor view, rows_per_block) tuple, got {type(entry).__name__}"
        )
    view, rows = entry[0], positive_int(f"rows_per_block of layer {name!r}", entry[1])
    if view.dim() < 2:
        raise ValueError(
            f"layer {name!r}: a {view.dim()}-D tensor is no layer view [blocks, ...]; pass the views "
            "allocate_kv_cache makes (raw buffers of specs without layer views cannot be zeroed by block)"
        )
    if view.shape[0] != num_blocks * rows:
        raise ValueError(
            f"layer {name!r} has {view.shape[0]} rows, not num_blocks * rows_per_block = "
            f"{num_blocks} * {rows}; pass the views as allocated with their split ratio"
        )
    return view, rows
