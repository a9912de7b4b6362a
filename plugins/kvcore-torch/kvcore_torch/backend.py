"""The ``torch`` attention backend class."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvcore.plugins.backend import AttentionBackend, CommonAttentionMetadata
from kvcore.plugins.paged_inputs import write_then_attend
from kvcore_torch.attention import paged_attention
from kvcore_torch.cache_write import write_kv


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention in plain PyTorch: any block size, any layout, CPU or GPU.

    The default metadata builder is enough: ``forward`` reads the common
    metadata (kernel block table, slot mapping, query offsets, lengths).
    """

    name: ClassVar[str] = "torch"

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
    ) -> torch.Tensor:
        """Write this step's K/V, then attend; rows past ``num_actual_tokens`` are padding.

        Uses the metadata's ``max_query_len``/``max_seq_len`` and runs no value
        check on GPUs (``metadata.debug_checks``, from ``KVCORE_DEBUG_CHECKS=1`` at
        ``KVCache.create``, turns them on): no device sync.
        """
        return write_then_attend(
            write_kv, paged_attention, query, key, value, kv_cache_view, metadata,
            head_size=head_size, scale=scale, sliding_window=sliding_window, out=out,
        )
