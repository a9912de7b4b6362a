"""The ``triton`` attention backend class."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvcore.plugins.backend import AttentionBackend, CommonAttentionMetadata
from kvcore.plugins.paged_inputs import write_then_attend
from kvcore_triton.attention import KernelConfig, paged_attention
from kvcore_triton.store import write_kv


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention: kernel blocks of 16, 32 or 64 tokens, any layout.

    Kernels read the cache through its strides; decode batches use a split-K
    kernel, mixed and prefill batches a varlen kernel. Runs on GPUs, and on
    CPU tensors through the Triton interpreter (``TRITON_INTERPRET=1``).
    """

    name: ClassVar[str] = "triton"

    write_kv = staticmethod(write_kv)
    paged_attention = staticmethod(paged_attention)

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_view: torch.Tensor,
        metadata: CommonAttentionMetadata,
        *,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
        config: KernelConfig | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; rows past ``num_actual_tokens`` are padding.

        Uses the metadata's ``max_query_len``/``max_seq_len`` and runs no value
        check on GPUs (``metadata.debug_checks``, from ``KVCORE_DEBUG_CHECKS=1`` at
        ``KVCache.create``, turns them on), so nothing
        here synchronizes the device and a whole step can be captured in a
        CUDA graph.
        """
        return write_then_attend(
            write_kv, paged_attention, query, key, value, kv_cache_view, metadata,
            head_size=head_size, scale=scale, sliding_window=sliding_window, out=out, config=config,
        )
