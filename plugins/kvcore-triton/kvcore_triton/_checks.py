"""Launcher-side checks: shapes, dtypes and devices before any kernel runs.

Each raises ``TypeError`` or ``ValueError`` naming the argument and the
accepted form, so a bad call never reaches (or half-runs) a kernel.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def check_cache_view(kv_cache_view: torch.Tensor, head_size: int, head_size_v: int | None) -> int:
    """Validate a kernel-block view ``[B, H, N, C]``; return ``head_size_v``."""
    if not isinstance(kv_cache_view, torch.Tensor) or kv_cache_view.dim() != 4:
        got = tuple(kv_cache_view.shape) if isinstance(kv_cache_view, torch.Tensor) else type(kv_cache_view).__name__
        raise TypeError(f"kv_cache_view must be a 4-D [blocks, heads, block_size, content] tensor, got {got}")
    if kv_cache_view.dtype not in DTYPES:
        raise TypeError(
            f"kv_cache_view has dtype {kv_cache_view.dtype}; the triton backend takes "
            f"{[str(d) for d in DTYPES]} (re-type the layer's view to the spec's dtype)"
        )
    content = kv_cache_view.shape[-1]
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if head_size_v is None:
        head_size_v = content - head_size
    if head_size_v <= 0 or head_size + head_size_v > content:
        raise ValueError(
            f"head_size={head_size} and head_size_v={head_size_v} do not fit the "
            f"{content} content elements of kv_cache_view; K is view[..., :head_size] "
            "and V follows it"
        )
    return head_size_v


def check_tokens(name: str, tensor: torch.Tensor, tokens: int, heads: int, size: int, like: torch.Tensor) -> None:
    """``tensor`` must be ``[tokens, heads, size]`` with ``like``'s dtype and device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != (tokens, heads, size):
        raise ValueError(f"{name} must have shape {(tokens, heads, size)}, got {tuple(tensor.shape)}")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the KV cache holds {like.dtype}; cast it first")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but the KV cache is on {like.device}; move it")


def check_index(name: str, tensor: torch.Tensor, dim: int, like: torch.Tensor | None = None) -> None:
    """``tensor`` must be an int32/int64 tensor of ``dim`` dims (on ``like``'s device)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim or tensor.dtype not in _INDEX_DTYPES:
        got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name} must be a {dim}-D int32 or int64 tensor, got {got}")
    if like is not None and tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but the KV cache is on {like.device}; move it")
