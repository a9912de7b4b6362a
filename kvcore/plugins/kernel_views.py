"""Kernel views of a packed cache: manager-block views re-addressed by kernel block.

A dense group is split into kernel blocks when it is allocated; a packed
(block-outermost) cache keeps manager-block views, and a backend taking
smaller blocks reads it through the strided views made here. Only compressed
caches (more than one token per state, one head) whose block stride is a
whole number of kernel pages can be re-addressed so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.specs import KVCacheSpec


def packed_split_error(backend: str, spec: KVCacheSpec, names: Sequence[str], kernel: int) -> ValueError:
    """The refusal of a packed cache that cannot be split into ``kernel``-token blocks."""
    return ValueError(
        f"{backend} needs {kernel}-token kernel blocks, which packed "
        f"{spec.block_size}-token blocks of {list(names)} cannot be split into; use a "
        f"manager block size of {kernel} or a layer-compact layout such as LBNHC"
    )


def packed_kernel_stride(
    spec: KVCacheSpec, block_stride_bytes: int, kernel: int, backend: str, names: Sequence[str]
) -> int:
    """Kernel pages between two manager blocks of a packed cache, else :func:`packed_split_error`."""
    rows = spec.get_num_kernel_states(kernel) if spec.tokens_per_state > 1 else 0
    page = rows * spec.state_content_size_bytes
    if spec.tokens_per_state <= 1 or spec.num_heads != 1 or block_stride_bytes % page:
        raise packed_split_error(backend, spec, names, kernel)
    return block_stride_bytes // page


def to_kernel_blocks(view: torch.Tensor, kernel_rows: int, stride: int) -> torch.Tensor:
    """A manager-block view ``[B, H, N, C]`` as ``[pages, H, kernel_rows, C]`` kernel pages.

    ``stride`` kernel pages lie between two manager blocks; the view spans
    other layers' pages between blocks without addressing them.
    """
    page_stride = kernel_rows * view.stride(-2)
    num_pages = (view.shape[0] - 1) * stride + view.shape[-2] // kernel_rows
    return view.as_strided(
        (num_pages, *view.shape[1:-2], kernel_rows, view.shape[-1]), (page_stride, *view.stride()[1:])
    )


def to_manager_blocks(view: torch.Tensor, rows: int, stride: int, num_blocks: int) -> torch.Tensor:
    """The inverse of :func:`to_kernel_blocks`: ``num_blocks`` manager blocks of ``rows`` states."""
    return view.as_strided(
        (num_blocks, *view.shape[1:-2], rows, view.shape[-1]), (view.stride(0) * stride, *view.stride()[1:])
    )


__all__ = ["packed_kernel_stride", "packed_split_error", "to_kernel_blocks", "to_manager_blocks"]
