"""The base KV cache spec and the ``MultipleOf`` block-size constraint."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import attrs
import torch

from kvcore._validate import attrs_positive, positive_int


@attrs.frozen
class MultipleOf:
    """A kernel block size constraint: any size divisible by ``base`` (an ``int`` takes itself)."""

    base: int = attrs.field(validator=attrs_positive)

    def accepts(self, block_size: int) -> bool:
        return block_size % self.base == 0


#: dtypes a cache cannot store: no byte view or kernel takes them.
_NOT_CACHE_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("bool", "qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


def check_cache_dtype(where: str, value: Any) -> torch.dtype:
    """``value`` if a KV cache can hold that dtype, else an error naming ``where``."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{where} must be a torch.dtype (e.g. torch.bfloat16), got {value!r}")
    if value in _NOT_CACHE_DTYPES or value.is_complex:
        raise ValueError(
            f"{where}={value} is not a dtype a KV cache can store; use a floating or integer "
            "dtype such as torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn or "
            "torch.int8 (store a complex value as two real ones)"
        )
    return value


def padded_page_size(spec: KVCacheSpec) -> int:
    """``page_size_bytes`` of a spec with a ``page_size_padded`` field (else the real page)."""
    return spec.real_page_size_bytes if spec.page_size_padded is None else spec.page_size_padded


def _optional_multiple_of(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, MultipleOf):
        raise TypeError(
            f"{type(inst).__name__}.{attribute.name} must be None or a MultipleOf, got {value!r}"
        )


@attrs.frozen
class KVCacheSpec:
    """Base of all specs: a cache whose manager blocks hold ``block_size`` tokens.

    A layer's view is ``[B, H, N, C]``: ``num_heads`` head slots, ``num_states``
    states per block (``tokens_per_state`` tokens each; <= 0: one state per
    block), ``state_content_size_bytes`` bytes per (head, state), re-typed to
    ``view_dtype``. The base view is one raw page per block, ``[B, 1, 1, page]``;
    subclasses define ``page_size_bytes`` (and the others for other views).
    ``page_size_padded``: bytes each page is padded to, or None.
    ``has_layer_views`` is False only for specs that lay out a raw buffer
    themselves, ``has_cache_pages`` only for layers that keep no pages
    (encoder-only attention); ``is_attention`` marks layers an attention
    backend serves. ``block_stride_alignment`` (a ``MultipleOf`` in tokens)
    asks packed layouts to keep blocks aligned to whole kernel blocks.
    """

    block_size: int = attrs.field(validator=attrs_positive)
    block_stride_alignment: MultipleOf | None = attrs.field(
        default=None, kw_only=True, validator=_optional_multiple_of
    )

    tokens_per_state = property(lambda self: -1)
    num_heads = property(lambda self: 1)
    view_dtype = property(lambda self: torch.int8)
    page_size_padded = property(lambda self: None)
    has_layer_views = property(lambda self: True)
    has_cache_pages = property(lambda self: True)
    is_attention = property(lambda self: False)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies (padding included)."""
        raise NotImplementedError(f"{type(self).__name__} does not define a page size")

    @property
    def num_states(self) -> int:
        """``N`` for a whole manager block."""
        return self.get_num_kernel_states(self.block_size)

    @property
    def state_content_size_bytes(self) -> int:
        """``C`` in bytes: content of one (head, state)."""
        return self.page_size_bytes

    @property
    def dtype_alignment(self) -> int:
        """Bytes every block and layer must start at a multiple of (the largest element)."""
        return self.view_dtype.itemsize

    @property
    def real_page_size_bytes(self) -> int:
        """``H * N * C``: the page without padding."""
        return self._page_of_tokens(self.block_size)

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """``N`` for a block of ``kernel_block_size`` tokens."""
        kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
        tps = self.tokens_per_state
        if tps <= 0:
            return 1
        states = Fraction(kernel_block_size) / tps
        if states.denominator != 1:
            raise ValueError(
                f"block size {kernel_block_size} does not hold a whole number of states at "
                f"tokens_per_state={tps}; use a block size divisible by {tps}"
            )
        return int(states)

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        """This spec with ``block_size``-token blocks (validated like a new spec)."""
        return attrs.evolve(self, block_size=block_size)

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        """Blocks a request of ``max_model_len`` tokens needs at most."""
        max_model_len = positive_int("max_model_len", max_model_len)
        return -(-max_model_len // self.block_size)

    def get_block_stride_alignment(self) -> int:
        """Bytes a packed block stride must be a multiple of.

        1 when no alignment is asked or the kernel block equals the block;
        else the page of a ``gcd(base, block_size)``-token block.
        """
        if self.block_stride_alignment is None:
            return 1
        tokens = math.gcd(self.block_stride_alignment.base, self.block_size)
        return 1 if tokens == self.block_size else self._page_of_tokens(tokens)

    def _page_of_tokens(self, tokens: int) -> int:
        """Unpadded bytes of a ``tokens``-token block."""
        return self.num_heads * self.get_num_kernel_states(tokens) * self.state_content_size_bytes

    def _check_page_padding(self, element: str) -> None:
        """``ValueError`` unless ``page_size_padded`` (if set) holds the page in whole elements."""
        padded, real, align = self.page_size_padded, self.real_page_size_bytes, self.dtype_alignment
        name = type(self).__name__
        if padded is not None and padded < real:
            raise ValueError(
                f"{name}.page_size_padded={padded} is smaller than the page it pads "
                f"({real} bytes); pass at least {real} or None"
            )
        if padded is not None and padded % align:
            raise ValueError(
                f"{name}.page_size_padded={padded} is not a multiple of {element}, so "
                f"blocks after the first would start mid-element; pass a multiple of "
                f"{align} (e.g. {-(-padded // align) * align}) or None"
            )
