"""The interfaces an attention backend implements.

A backend is a class (never instantiated by kvcore) with a unique ``name``.
What it accepts — kernel block sizes, layouts, spec changes — is declared
through the plugin hooks in :mod:`kvcore.plugins.hookspecs`, not through attributes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from kvcore.specs import KVCacheSpec


@attrs.frozen(kw_only=True)
class CommonAttentionMetadata:
    """Per-step batch description shared by every attention group.

    ``query_start_loc`` (``[num_reqs + 1]``, int32) delimits each request's new
    tokens; ``seq_lens`` (``[num_reqs]``) counts each request's tokens including
    the new ones; ``block_table_tensor`` (``[num_reqs, max_blocks]``, int32)
    holds manager block ids; ``slot_mapping`` (``[num_actual_tokens]``, int64)
    gives each new token's slot ``block_id * block_size + offset``.
    """

    query_start_loc: torch.Tensor = attrs.field(eq=False, repr=False)
    seq_lens: torch.Tensor = attrs.field(eq=False, repr=False)
    block_table_tensor: torch.Tensor = attrs.field(eq=False, repr=False)
    slot_mapping: torch.Tensor = attrs.field(eq=False, repr=False)
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True


class AttentionMetadataBuilder:
    """Turns :class:`CommonAttentionMetadata` into a backend's own metadata.

    One builder exists per micro-batch, so persistent buffers kept by a builder
    (for CUDA graphs) never collide. The default ``build`` returns the common
    metadata unchanged.
    """

    #: Set to True to receive ``block_table_width`` (columns of the block table).
    requires_block_table_width: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        device: torch.device | str,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_table_width: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = list(layer_names)
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_table_width = block_table_width

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, **kwargs: Any
    ) -> Any:
        return common_attn_metadata


class AttentionBackend:
    """Base class of attention backends; subclasses set ``name``."""

    name: ClassVar[str]

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return AttentionMetadataBuilder
