"""The ``flashinfer`` attention backend class."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvcore.errors import KVCoreError
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.paged_inputs import check_heads_and_window, step_checks
from kvcore_flashinfer._runtime import DTYPES, check_quant, check_view, flashinfer, kv_pair
from kvcore_flashinfer.builder import FlashInferMetadata, FlashInferMetadataBuilder, PlanKey


def _store():
    """kvcore's K/V store into a strided view: the Triton one where present, else the torch one."""
    try:
        from kvcore_triton import write_kv
    except ImportError:
        try:
            from kvcore_torch import write_kv
        except ImportError:
            raise KVCoreError(
                "the 'flashinfer' backend writes K/V with kvcore-triton or kvcore-torch, neither is "
                "installed; `pip install kvcore-flashinfer[kernels]`"
            ) from None
    return write_kv


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer's paged decode and prefill kernels over kvcore's kernel views (no copy).

    K and V are the strided slices ``view[..., :D]`` and ``view[..., D:2D]`` of
    each layer's ``[B, H, N, C]`` view, read as FlashInfer's NHD or HND pages.
    Decode-only steps use ``BatchDecodeWithPagedKVCacheWrapper``, others
    (prefill, chunked prefill and decode rows together) the prefill wrapper.
    """

    name: ClassVar[str] = "flashinfer"

    @classmethod
    def get_builder_cls(cls) -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_view: torch.Tensor,
        metadata: FlashInferMetadata,
        *,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; rows past ``num_actual_tokens`` are padding.

        ``metadata`` comes from :class:`FlashInferMetadataBuilder` (``KVCache.build_metadata``).
        Raises :class:`kvcore.errors.KVCoreError` off CUDA, without FlashInfer, or for a
        cache FlashInfer cannot read, before anything is written.
        """
        if not isinstance(metadata, FlashInferMetadata):
            raise TypeError(
                f"the 'flashinfer' backend takes the metadata its builder builds (KVCache.build_metadata), "
                f"got {type(metadata).__name__}"
            )
        head_size_v = value.shape[-1]
        check_view(kv_cache_view, head_size, head_size_v)
        quant = metadata.kv_quant
        check_quant(kv_cache_view, quant)
        flashinfer()
        q_dtype = kv_cache_view.dtype if quant is None else query.dtype
        # NOTE: over an fp8 cache the query stays in the model's float16 or bfloat16.
        if query.dim() != 3 or query.shape[-1] != head_size or query.dtype != q_dtype or (
            quant is not None and q_dtype not in DTYPES
        ):
            raise ValueError(
                f"query must be [tokens, query heads, {head_size}] in {q_dtype}, got "
                f"{tuple(query.shape)} in {query.dtype}"
            )
        num_kv_heads = kv_cache_view.shape[1]
        check_heads_and_window(query.shape[1], num_kv_heads, sliding_window)
        if out is None:
            out = query.new_empty(query.shape[0], query.shape[1], head_size_v)
        elif tuple(out.shape) != (query.shape[0], query.shape[1], head_size_v) or out.dtype != query.dtype:
            raise ValueError(
                f"out must be a {(query.shape[0], query.shape[1], head_size_v)} {query.dtype} tensor, got "
                f"{tuple(out.shape)} {out.dtype}"
            )
        n = metadata.num_actual_tokens
        _store()(kv_cache_view, key[:n], value[:n], metadata.slot_mapping[:n], head_size,
                 validate=step_checks(metadata.common.debug_checks, kv_cache_view.device),
                 **({} if quant is None else {"kv_quant": quant}))
        if n == 0:
            return out
        layout, k_cache, v_cache = kv_pair(kv_cache_view, head_size)
        plan_key = PlanKey(
            query.shape[1], num_kv_heads, head_size, query.dtype, layout,
            -1 if sliding_window is None else sliding_window - 1, float(scale),
            None if quant is None else kv_cache_view.dtype,
        )
        q = query[:n] if query.stride(-1) == 1 else query[:n].contiguous()
        rows = out[:n]
        # NOTE: FlashInfer writes its output densely ([tokens, heads, dim], no strides).
        dense = rows if rows.is_contiguous() else torch.empty_like(rows, memory_format=torch.contiguous_format)
        scales = {} if quant is None else {"k_scale": quant.k_scale, "v_scale": quant.v_scale}
        metadata.wrapper(plan_key).run(q, (k_cache, v_cache), out=dense, **scales)
        if dense is not rows:
            rows.copy_(dense)
        return out
