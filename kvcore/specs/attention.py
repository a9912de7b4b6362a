"""Attention specs: paged K/V (or latent) caches, one block table per group."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import attrs
import torch

from kvcore._validate import attrs_non_negative, attrs_positive
from kvcore.specs.base import KVCacheSpec, check_cache_dtype, optional_positive, padded_page_size
from kvcore.specs.quant import PER_TOKEN_HEAD, SCALE_BYTES, check_kv_quant


def _tokens_per_state(value: Any) -> int | Fraction:
    """Integral Fractions become ints; anything but an int or a Fraction is a ``TypeError``."""
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("tokens_per_state must be an int or a fractions.Fraction, "
                        f"got {value!r} ({type(value).__name__})")
    return value


def _head_size_v(default: int | None) -> Any:
    validator = attrs.validators.optional(attrs_non_negative)
    return attrs.field(default=default, kw_only=True, validator=validator)


@attrs.frozen
class AttentionSpec(KVCacheSpec):
    """Paged attention: ``C`` packs K then V of one head at one state; a
    ``tokens_per_state`` > 1 compresses tokens, a ``Fraction`` < 1 stores several states per
    token, <= 0 one state per block. ``kv_quant`` (None, ``"per_tensor"``, ``"per_token_head"``)
    says how an 8-bit ``dtype`` is scaled; per-token-head scales follow the data in each page."""

    num_kv_heads: int = attrs.field(validator=attrs_positive)
    head_size: int = attrs.field(validator=attrs_positive)
    dtype: torch.dtype = attrs.field(
        validator=lambda inst, a, v: check_cache_dtype(f"{type(inst).__name__}.{a.name}", v)
    )
    head_size_v: int | None = _head_size_v(None)
    page_size_padded: int | None = optional_positive()  # type: ignore[assignment]
    num_head_slots: int | None = optional_positive()
    state_content_bytes: int | None = optional_positive()
    tokens_per_state: int | Fraction = attrs.field(  # type: ignore[assignment]
        default=1, kw_only=True, converter=_tokens_per_state
    )
    kv_quant: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        tps = self.tokens_per_state
        if isinstance(tps, Fraction) and not 0 < tps < 1:
            raise ValueError(f"{name}.tokens_per_state={tps} is a fraction outside (0, 1); pass an int (> 1 compresses "
                             "tokens, <= 0 keeps one state per block) or a Fraction below 1 (several states per token)")
        self.get_num_kernel_states(self.block_size)  # NOTE: raises unless blocks hold whole states
        itemsize = self.dtype.itemsize
        if self.state_content_size_bytes % itemsize:
            raise ValueError(f"{name}: {self.state_content_size_bytes} content bytes per "
                             f"state is not a multiple of the {itemsize}-byte {self.dtype}; "
                             "set state_content_bytes to a multiple of the element size")
        check_kv_quant(self)
        self._check_page_padding(f"the {itemsize}-byte {self.dtype}")

    page_size_bytes = property(padded_page_size)

    is_attention = property(lambda self: True)
    view_dtype = property(lambda self: self.dtype, doc="The cache dtype.")

    @property
    def num_heads(self) -> int:
        """``H``: ``num_head_slots`` when a backend padded the heads, else ``num_kv_heads``."""
        return self.num_head_slots or self.num_kv_heads

    @property
    def scale_size_bytes(self) -> int:
        """8 (a float32 K and V scale per head and token) for per-token-head caches, else 0."""
        return SCALE_BYTES if self.kv_quant == PER_TOKEN_HEAD else 0

    dtype_alignment = property(lambda self: 4 if self.scale_size_bytes else self.dtype.itemsize)  # NOTE: float32 scales

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * self.dtype.itemsize


@attrs.frozen
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context (a merged layer's window kept in its fields)."""

    sliding_window: int | None = optional_positive()
    attention_chunk_size: int | None = optional_positive()


@attrs.frozen
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens."""

    sliding_window: int = attrs.field(kw_only=True, validator=attrs_positive)


@attrs.frozen
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int = attrs.field(kw_only=True, validator=attrs_positive)


@attrs.frozen
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per state (no separate V)."""

    head_size_v: int | None = _head_size_v(0)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(f"MLAAttentionSpec.num_kv_heads={self.num_kv_heads}: MLA stores one latent vector per "
                             "token, shared by all heads, so num_kv_heads must be 1 (put the latent size in head_size)")


@attrs.frozen
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder attention: no KV cache pages are allocated."""

    has_cache_pages = property(lambda self: False, doc="Always False: encoder-only attention keeps no pages.")


@attrs.frozen
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention of encoder-decoder models."""
