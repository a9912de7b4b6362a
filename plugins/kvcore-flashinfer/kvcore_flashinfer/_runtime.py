"""Where FlashInfer is imported (on first use, never by the hooks) and what ``forward`` refuses."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvcore.errors import KVCoreError

#: Cache dtypes FlashInfer's paged fp16/bf16 kernels take.
DTYPES = (torch.float16, torch.bfloat16)
#: Per-tensor quantized caches it reads (``kv_data_type``, with ``k_scale``/``v_scale`` at run).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Head sizes its paged decode and prefill kernels are built for (``DISPATCH_HEAD_DIM``).
HEAD_SIZES = (64, 128, 256)
#: Query heads per KV head its CUDA-core decode kernel is built for; other groups decode
#: through the prefill kernel (``DISPATCH_GQA_GROUP_SIZE``).
DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)
#: FlashInfer keeps page, token and head strides as uint32 element counts.
MAX_STRIDE_ELEMENTS = 2**32


@functools.cache
def flashinfer() -> Any:
    """The ``flashinfer`` module, or a :class:`KVCoreError` saying how to install it."""
    try:
        import flashinfer as module
    except ImportError as exc:
        raise KVCoreError(
            "the 'flashinfer' backend needs FlashInfer, which is not importable here "
            f"({exc}); install it with `pip install kvcore-flashinfer[kernels]` "
            "(flashinfer-python), or serve with backend='triton' or 'torch'"
        ) from None
    return module


def check_view(kv_cache_view: torch.Tensor, head_size: int, head_size_v: int) -> None:
    """Refuse, before any kernel runs, what FlashInfer cannot read; name the remedy."""
    if not isinstance(kv_cache_view, torch.Tensor) or kv_cache_view.dim() != 4:
        raise TypeError("kv_cache_view must be a 4-D [blocks, heads, block_size, content] tensor")
    if kv_cache_view.device.type != "cuda":
        raise KVCoreError(
            f"the 'flashinfer' backend runs on CUDA devices only; this KV cache is on "
            f"{kv_cache_view.device}: create the KVCache on a CUDA device, or use the 'torch' backend "
            "(or 'triton' with TRITON_INTERPRET=1) on the CPU"
        )
    if kv_cache_view.dtype not in DTYPES + FP8_DTYPES:
        raise KVCoreError(
            f"the 'flashinfer' backend takes float16/bfloat16 caches (or fp8 ones quantized per "
            f"tensor), got {kv_cache_view.dtype}; plan the cache in float16 or bfloat16 (or "
            "kv_cache_dtype='fp8'), or use the 'triton' backend"
        )
    if head_size not in HEAD_SIZES or head_size_v != head_size:
        raise KVCoreError(
            f"the 'flashinfer' backend takes K and V head sizes in {list(HEAD_SIZES)} and equal, got "
            f"{head_size} and {head_size_v}; use the 'triton' backend for this model"
        )
    if kv_cache_view.shape[-1] < head_size + head_size_v or kv_cache_view.stride(-1) != 1:
        raise KVCoreError(
            f"the 'flashinfer' backend reads K and V as contiguous slices of the last dim; the view "
            f"{tuple(kv_cache_view.shape)} with strides {kv_cache_view.stride()} does not hold them"
        )
    big = [s for s in kv_cache_view.stride() if s >= MAX_STRIDE_ELEMENTS]
    if big:
        raise KVCoreError(
            f"the 'flashinfer' backend narrows strides to 32 bits, the view has stride {big[0]} "
            f">= 2**32 elements; pick a block-compact layout (LBNHC, LBHNC) or fewer blocks"
        )


def check_quant(kv_cache_view: torch.Tensor, kv_quant: Any) -> None:
    """A quantized cache FlashInfer reads: fp8 with one K and one V scale per layer."""
    if kv_quant is None:
        if kv_cache_view.dtype in FP8_DTYPES:
            raise KVCoreError("an fp8 cache view came without its scales (metadata.kv_quant); build the "
                              "metadata with KVCache.build_metadata")
        return
    if kv_quant.kv_quant != "per_tensor" or kv_cache_view.dtype not in FP8_DTYPES:
        raise KVCoreError(
            f"the 'flashinfer' backend reads fp8 caches quantized per tensor, not {kv_quant.kv_quant} "
            f"{kv_cache_view.dtype}; use kv_cache_dtype='fp8' or the 'triton' backend"
        )


def kv_pair(kv_cache_view: torch.Tensor, head_size: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """``(kv_layout, K, V)``: strided slices of ``[B, H, N, C]``, no copy.

    "HND" (``[pages, heads, tokens, dim]``) where a page's heads lie further apart than its
    tokens, else "NHD" (``[pages, tokens, heads, dim]``); FlashInfer takes every stride as given.
    """
    if kv_cache_view.stride(1) >= kv_cache_view.stride(2):
        view, layout = kv_cache_view, "HND"
    else:
        view, layout = kv_cache_view.permute(0, 2, 1, 3), "NHD"
    return layout, view[..., :head_size], view[..., head_size : 2 * head_size]
