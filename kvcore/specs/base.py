"""The base KV cache spec, ``MultipleOf``, a group of one spec type, and shared validators."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import attrs
import torch

from kvcore._validate import attrs_optional_positive, attrs_positive, positive_int

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
        raise ValueError(f"{where}={value} is not a dtype a KV cache can store; use a floating or "
                         "integer dtype such as torch.bfloat16, torch.float16, torch.float32, "
                         "torch.float8_e4m3fn or torch.int8 (store a complex value as two real ones)")
    return value


def optional_positive() -> Any:
    return attrs.field(default=None, kw_only=True, validator=attrs_optional_positive)


def padded_page_size(spec: KVCacheSpec) -> int:
    return spec.real_page_size_bytes if spec.page_size_padded is None else spec.page_size_padded


@attrs.frozen
class MultipleOf:
    """A kernel block size constraint: any size divisible by ``base`` (an ``int`` takes itself)."""

    base: int = attrs.field(validator=attrs_positive)

    def accepts(self, block_size: int) -> bool:
        return block_size % self.base == 0


def _optional_multiple_of(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, MultipleOf):
        raise TypeError(f"{type(inst).__name__}.{attribute.name} must be None or a MultipleOf, got {value!r}")


@attrs.frozen
class KVCacheSpec:
    """Base of all specs: a cache whose manager blocks hold ``block_size`` tokens.

    A layer's view is ``[B, H, N, C]``: ``H`` head slots (``num_heads``), ``N`` states per block
    (``tokens_per_state`` tokens each; <= 0: one state per block) and ``C`` content bytes per
    (head, state), re-typed to ``view_dtype``. The base view is one raw page per block,
    ``[B, 1, 1, page]``; subclasses define ``page_size_bytes`` and the others for other views.
    ``has_layer_views`` is False only for specs that lay out a raw buffer themselves,
    ``has_cache_pages`` False only for layers that keep no pages (encoder-only attention).
    ``block_stride_alignment`` (a ``MultipleOf`` in tokens) asks packed layouts to keep blocks
    aligned to whole kernel blocks.
    """

    block_size: int = attrs.field(validator=attrs_positive)
    block_stride_alignment: MultipleOf | None = attrs.field(default=None, kw_only=True, validator=_optional_multiple_of)

    @property
    def tokens_per_state(self) -> int | Fraction:
        """Tokens one state holds (<= 0: one state per block, whatever its size)."""
        return -1

    @property
    def num_heads(self) -> int:
        """``H``: head slots of a layer's view."""
        return 1

    @property
    def view_dtype(self) -> torch.dtype:
        """The dtype a layer's view is re-typed to."""
        return torch.int8

    @property
    def page_size_padded(self) -> int | None:
        """Bytes each page is padded to, or None for no padding."""
        return None

    @property
    def has_layer_views(self) -> bool:
        """False when the spec's owner lays out a raw buffer itself (no ``[B, H, N, C]`` view)."""
        return True

    @property
    def has_cache_pages(self) -> bool:
        """False for layers that keep no pages (encoder-only attention)."""
        return True

    @property
    def is_attention(self) -> bool:
        """Whether an attention backend serves these layers."""
        return False

    @property
    def num_states(self) -> int:
        """``N`` for a whole manager block."""
        return self.get_num_kernel_states(self.block_size)

    @property
    def state_content_size_bytes(self) -> int:
        """``C`` in bytes: the content of one (head, state)."""
        return self.page_size_bytes

    @property
    def scale_size_bytes(self) -> int:
        """Scale bytes per (head, state) kept in the page after the data (0: none)."""
        return 0

    @property
    def dtype_alignment(self) -> int:
        """Bytes every block and layer must start at a multiple of (the largest element)."""
        return self.view_dtype.itemsize

    @property
    def real_page_size_bytes(self) -> int:
        """``H * N * C``: the page without padding."""
        return self._page_of_tokens(self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies (padding included)."""
        raise NotImplementedError(f"{type(self).__name__} does not define a page size")

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """``N`` for a block of ``kernel_block_size`` tokens."""
        kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
        tps = self.tokens_per_state
        if tps <= 0:
            return 1
        states = Fraction(kernel_block_size) / tps
        if states.denominator != 1:
            raise ValueError(f"block size {kernel_block_size} does not hold a whole number of states "
                             f"at tokens_per_state={tps}; use a block size divisible by {tps}")
        return int(states)

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        return attrs.evolve(self, block_size=block_size)

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        max_model_len = positive_int("max_model_len", max_model_len)
        return -(-max_model_len // self.block_size)

    def get_block_stride_alignment(self) -> int:
        """Bytes a packed block stride must be a multiple of: a ``gcd(base, block_size)`` page."""
        if self.block_stride_alignment is None:
            return 1
        tokens = math.gcd(self.block_stride_alignment.base, self.block_size)
        return 1 if tokens == self.block_size else self._page_of_tokens(tokens)

    def _page_of_tokens(self, tokens: int) -> int:
        rows = self.num_heads * self.get_num_kernel_states(tokens)
        return rows * (self.state_content_size_bytes + self.scale_size_bytes)

    def _check_page_padding(self, element: str) -> None:
        padded, real, align = self.page_size_padded, self.real_page_size_bytes, self.dtype_alignment
        name = type(self).__name__
        if padded is not None and padded < real:
            raise ValueError(f"{name}.page_size_padded={padded} is smaller than the page "
                             f"it pads ({real} bytes); pass at least {real} or None")
        if padded is not None and padded % align:
            raise ValueError(f"{name}.page_size_padded={padded} is not a multiple of {element}, "
                             "so blocks after the first would start mid-element; pass a "
                             f"multiple of {align} (e.g. {-(-padded // align) * align}) or None")


def _spec_mapping(value: Any) -> dict[str, KVCacheSpec]:
    if not isinstance(value, Mapping):
        raise TypeError(f"UniformTypeKVCacheSpecs.kv_cache_specs must map layer names to specs, got {value!r}")
    return dict(value)


@attrs.frozen
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One KV cache group of layers of one spec type but different shapes (page: their sum)."""

    kv_cache_specs: dict[str, KVCacheSpec] = attrs.field(converter=_spec_mapping, hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec")
        for name, spec in self.kv_cache_specs.items():
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(f"UniformTypeKVCacheSpecs: layer {name!r} maps to {spec!r}, not a KVCacheSpec")
        kinds = {type(s) for s in self.kv_cache_specs.values()}
        if len(kinds) != 1:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ValueError(f"UniformTypeKVCacheSpecs needs layers of one spec type, got {names}")
        for name, spec in self.kv_cache_specs.items():
            if spec.block_size != self.block_size:
                raise ValueError(f"layer {name!r} has block size {spec.block_size}, the group "
                                 f"has {self.block_size}; give every layer the same block size")

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        """Whether the specs can share one group: one type, block size and attention window."""
        kinds = set()
        for s in kv_cache_specs.values():
            window = getattr(s, "sliding_window", None), getattr(s, "attention_chunk_size", None)
            kinds.add((type(s), s.block_size, *window))
        return len(kinds) == 1

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """Group ``kv_cache_specs`` when they can share one group, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        return cls(next(iter(kv_cache_specs.values())).block_size, kv_cache_specs)

    # NOTE: the layers share one spec type: their first one's tokens per state and kind speak for all
    _first = property(lambda self: next(iter(self.kv_cache_specs.values())))
    tokens_per_state = property(lambda self: self._first.tokens_per_state)
    has_cache_pages = property(lambda self: self._first.has_cache_pages)
    is_attention = property(lambda self: self._first.is_attention)
    page_size_bytes = property(lambda self: sum(s.page_size_bytes for s in self.kv_cache_specs.values()),
                               doc="The sum of the layers' pages.")
    dtype_alignment = property(lambda self: math.lcm(*(s.dtype_alignment for s in self.kv_cache_specs.values())),
                               doc="The least common multiple of the layers' alignments.")

    def _page_of_tokens(self, tokens: int) -> int:
        return sum(s._page_of_tokens(tokens) for s in self.kv_cache_specs.values())

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        specs = {n: s.copy_with_new_block_size(block_size) for n, s in self.kv_cache_specs.items()}
        return UniformTypeKVCacheSpecs(block_size, specs)

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return max(s.max_num_blocks_per_req(max_model_len) for s in self.kv_cache_specs.values())
