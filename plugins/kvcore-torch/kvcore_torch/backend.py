"""The ``torch`` attention backend class."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvcore.plugins.backend import AttentionBackend, CommonAttentionMetadata
from kvcore.plugins.paged_inputs import step_checks
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
        n = metadata.num_actual_tokens
        # NOTE: the metadata's switch, never the environment (this runs per layer).
        validate = step_checks(metadata.debug_checks, kv_cache_view.device)
        write_kv(kv_cache_view, key[:n], value[:n], metadata.slot_mapping[:n], head_size, validate=validate)
        return paged_attention(
            query[:n],
            kv_cache_view,
            metadata.block_table_tensor,
            metadata.query_start_loc,
            metadata.seq_lens,
            head_size=head_size,
            scale=scale,
            sliding_window=sliding_window,
            head_size_v=value.shape[-1],
            out=None if out is None else out[:n],
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            validate=validate,
        )
