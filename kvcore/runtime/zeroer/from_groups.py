"""The seed's zeroer arguments (attention groups + kernel block sizes) as views plus rows per block.

``KVBlockZeroer(device, attn_groups, kernel_block_sizes, kv_caches, ...)``
keeps working through this translation; ``KVBlockZeroer.from_views`` is the
direct form, fed from the negotiation record without any attention group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.runtime.attn_group import AttentionGroup, flatten_attention_groups


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
        ratio = _ratio(group, kernel_block_sizes)
        for name in group.layer_names:
            view = kv_caches.get(name)
            if name in skip or not isinstance(view, torch.Tensor):
                continue
            if group.kernel_block_stride:
                # NOTE: packed kernel-block views: zero by manager block instead.
                views[name] = (group.map_kv_cache_to_manager_blocks(view, num_blocks), 1)
            else:
                views[name] = (view, _rows_per_block(name, view, ratio, num_blocks))
    return views


def _ratio(group: AttentionGroup, kernel_block_sizes: list[int | None]) -> int:
    block_size = group.kv_cache_spec.block_size
    kernel = group.kernel_block_size
    if kernel is None and group.kv_cache_group_id < len(kernel_block_sizes):
        kernel = kernel_block_sizes[group.kv_cache_group_id]
    kernel = block_size if kernel is None else positive_int("kernel block size", kernel)
    if block_size % kernel:
        raise ValueError(
            f"group {group.kv_cache_group_id}: block size {block_size} is not divisible by "
            f"kernel block size {kernel}; pass kernel_block_sizes that divide the block sizes"
        )
    return block_size // kernel


def _rows_per_block(name: str, view: torch.Tensor, ratio: int, num_blocks: int) -> int:
    """View rows per manager block: ``ratio`` for a view split at allocation, else 1."""
    if ratio == 1 or view.shape[0] == num_blocks * ratio:
        return ratio
    if view.shape[0] == num_blocks:
        return 1
    raise ValueError(
        f"layer {name!r} has {view.shape[0]} rows, neither {num_blocks} manager "
        f"blocks nor {num_blocks * ratio} kernel blocks; pass the num_blocks and "
        "kernel_block_sizes the caches were allocated with"
    )
