"""The protocol an attention backend implements: a class (never instantiated by kvcore) with a
unique ``name``; what it accepts is declared through the hooks, not through attributes."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from kvcore.specs import KVCacheSpec


@attrs.frozen(eq=False)
class KVQuantState:
    """How one layer's cache is quantized (``metadata.kv_quant``): ``"per_tensor"`` (stored ``x / k_scale``
    or ``x / v_scale``, saturated to ``dtype``) or ``"per_token_head"`` (stored ``x / scale``, ``scale =
    amax(|x|) / max(dtype)`` per token and head, 0 for a zero row, kept in ``scale_cache``: the float32
    ``[B', H, N, 2]`` K and V scales, addressed like the layer's kernel view)."""

    kv_quant: str
    dtype: torch.dtype
    k_scale: float = 1.0
    v_scale: float = 1.0
    scale_cache: torch.Tensor | None = attrs.field(default=None, repr=False)


@attrs.frozen(kw_only=True)
class CommonAttentionMetadata:
    """Per-step batch description shared by every attention group.

    ``query_start_loc`` (``[num_reqs + 1]``, int32) delimits each request's new tokens;
    ``seq_lens`` (``[num_reqs]``) counts each request's tokens including the new ones;
    ``block_table_tensor`` (``[num_reqs, max_blocks]``, int32) holds manager block ids;
    ``slot_mapping`` (``[num_actual_tokens]``, int64) gives each new token's slot
    ``block_id * block_size + offset``. ``debug_checks``: whether ``forward`` runs the value
    checks (:func:`kvcore.plugins.paged_inputs.step_checks`).
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
    debug_checks: bool | None = None
    #: The layer's :class:`KVQuantState` (None: an unquantized cache); set per layer by the core.
    kv_quant: KVQuantState | None = None


@attrs.define(slots=False, eq=False)
class AttentionMetadataBuilder:
    """Turns :class:`CommonAttentionMetadata` into a backend's metadata (one per micro-batch)."""

    #: Set to True to receive ``block_table_width`` (columns of the block table).
    requires_block_table_width: ClassVar[bool] = False

    kv_cache_spec: KVCacheSpec
    layer_names: list[str] = attrs.field(converter=list)
    device: torch.device = attrs.field(converter=torch.device)
    max_num_seqs: int = attrs.field(kw_only=True)
    max_model_len: int = attrs.field(kw_only=True)
    block_table_width: int | None = attrs.field(default=None, kw_only=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, **kwargs: Any) -> Any:
        return common_attn_metadata


class AttentionBackend:
    """Base class of attention backends: the protocol every backend implements.

    A subclass sets a non-empty str ``name`` and overrides :meth:`forward` (``register()``
    refuses it otherwise); ``get_builder_cls()`` may return its metadata builder.
    """

    name: ClassVar[str]

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return AttentionMetadataBuilder

    @staticmethod
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache_view: torch.Tensor,
        metadata: Any,
        *,
        head_size: int,
        scale: float,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache_view``, then attend.

        :param query: ``[tokens, q_heads, head_size]``; rows past
            ``metadata.num_actual_tokens`` are padding. ``key``/``value``: this step's K/V,
            ``[tokens, kv_heads, head_size]`` / ``[tokens, kv_heads, head_size_v]``.
        :param kv_cache_view: the layer's kernel view (``KVCache.layer_kv_caches``).
        :param metadata: what the backend's builder built (block tables in kernel blocks).
        :param sliding_window: attend to at most this many past tokens, or None.
        :param out: optional ``[tokens, q_heads, head_size_v]`` buffer: when given, the output is
            written into it and it is returned.
        :returns: the attention output, ``[tokens, q_heads, head_size_v]`` (callers use this).
        """
        raise NotImplementedError(f"{AttentionBackend.__qualname__}.forward is the "
                                  "protocol; an attention backend overrides it")

