"""KV cache specs: what one layer stores per block.

A spec describes one layer's cache in the logical shape ``[B, H, N, C]``:
``B`` blocks of ``block_size`` tokens, ``H`` head slots, ``N`` stored states
per block and ``C`` content bytes per (head, state). Specs are frozen attrs
classes validated at construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import attrs
import torch

from kvcore._validate import (
    as_int,
    attrs_non_negative,
    attrs_optional_positive,
    attrs_positive,
    positive_int,
)


@attrs.frozen
class MultipleOf:
    """A kernel block size constraint: any size divisible by ``base``.

    A bare ``int`` in a backend's list of kernel block sizes accepts only
    itself; ``MultipleOf(16)`` accepts 16, 32, 48, ...
    """

    base: int = attrs.field(validator=attrs_positive)

    def accepts(self, block_size: int) -> bool:
        return block_size % self.base == 0


def _optional_multiple_of(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, MultipleOf):
        raise TypeError(
            f"{type(inst).__name__}.{attribute.name} must be None or a MultipleOf, "
            f"got {value!r}"
        )


def _check_dtype(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{type(inst).__name__}.{attribute.name} must be a torch.dtype "
            f"(e.g. torch.bfloat16), got {value!r}"
        )


def _tokens_per_state(value: Any) -> int | Fraction:
    """Normalize ``tokens_per_state``: integral Fractions become ints."""
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            "tokens_per_state must be an int or a fractions.Fraction, "
            f"got {value!r} ({type(value).__name__})"
        )
    return value


@attrs.frozen
class KVCacheSpec:
    """Base of all specs: a cache whose manager blocks hold ``block_size`` tokens.

    Subclasses define ``page_size_bytes`` and, for views, ``tokens_per_state``,
    ``num_heads``, ``state_content_size_bytes`` and ``view_dtype``.
    ``block_stride_alignment`` (a ``MultipleOf`` in tokens) asks packed layouts
    to keep blocks aligned to whole kernel blocks of that many tokens.
    """

    block_size: int = attrs.field(validator=attrs_positive)
    block_stride_alignment: MultipleOf | None = attrs.field(
        default=None, kw_only=True, validator=_optional_multiple_of
    )

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies (padding included)."""
        raise NotImplementedError(f"{type(self).__name__} does not define a page size")

    @property
    def tokens_per_state(self) -> int | Fraction:
        """Tokens per stored state; <= 0 means one state per block."""
        # NOTE: the base view is one raw page per block, [B, 1, 1, page].
        return -1

    @property
    def num_heads(self) -> int:
        """``H``: head slots of the logical view."""
        return 1

    @property
    def num_states(self) -> int:
        """``N`` for a whole manager block."""
        return self.get_num_kernel_states(self.block_size)

    @property
    def state_content_size_bytes(self) -> int:
        """``C`` in bytes: content of one (head, state)."""
        return self.page_size_bytes

    @property
    def view_dtype(self) -> torch.dtype:
        """The dtype per-layer views are re-typed to."""
        return torch.int8

    @property
    def real_page_size_bytes(self) -> int:
        """``H * N * C``: the page without padding."""
        return self.num_heads * self.num_states * self.state_content_size_bytes

    @property
    def page_size_padded(self) -> int | None:
        """Bytes each page is padded to, or None."""
        return None

    @property
    def has_layer_views(self) -> bool:
        """False only for specs that lay out a raw buffer themselves."""
        return True

    def get_num_kernel_states(self, kernel_block_size: int) -> int:
        """``N`` for a block of ``kernel_block_size`` tokens."""
        kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
        tps = self.tokens_per_state
        if tps <= 0:
            return 1
        states = Fraction(kernel_block_size) / tps
        if states.denominator != 1:
            raise ValueError(
                f"block size {kernel_block_size} does not hold a whole number "
                f"of states at tokens_per_state={tps}; use a block size divisible "
                f"by {tps}"
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
        if tokens == self.block_size:
            return 1
        return self._page_of_tokens(tokens)

    def _page_of_tokens(self, tokens: int) -> int:
        """Unpadded bytes of a ``tokens``-token block."""
        return self.num_heads * self.get_num_kernel_states(tokens) * self.state_content_size_bytes


@attrs.frozen
class AttentionSpec(KVCacheSpec):
    """Paged attention: ``C`` packs K then V of one head at one state.

    ``head_size_v=None`` means equal to ``head_size``. ``num_head_slots``
    overrides ``H`` (e.g. padded heads), ``state_content_bytes`` overrides
    ``C`` (e.g. quantized K/V with scales), ``page_size_padded`` pads each page.
    ``tokens_per_state`` > 1 compresses several tokens into one state; a
    ``Fraction`` < 1 stores several states per token; <= 0 stores one state per
    block whatever its size.
    """

    num_kv_heads: int = attrs.field(validator=attrs_positive)
    head_size: int = attrs.field(validator=attrs_positive)
    dtype: torch.dtype = attrs.field(validator=_check_dtype)
    head_size_v: int | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs_non_negative),
    )
    page_size_padded: int | None = attrs.field(  # type: ignore[assignment]
        default=None, kw_only=True, validator=attrs_optional_positive
    )
    num_head_slots: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs_optional_positive
    )
    state_content_bytes: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs_optional_positive
    )
    tokens_per_state: int | Fraction = attrs.field(  # type: ignore[assignment]
        default=1, kw_only=True, converter=_tokens_per_state
    )

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        tps = self.tokens_per_state
        if isinstance(tps, Fraction) and not 0 < tps < 1:
            raise ValueError(
                f"{name}.tokens_per_state={tps} is a fraction outside (0, 1); pass an "
                "int (> 1 compresses tokens, <= 0 keeps one state per block) or a "
                "Fraction below 1 (several states per token)"
            )
        # Raises when block_size does not hold whole states.
        self.get_num_kernel_states(self.block_size)
        itemsize = self.dtype.itemsize
        if self.state_content_size_bytes % itemsize:
            raise ValueError(
                f"{name}: {self.state_content_size_bytes} content bytes per state is "
                f"not a multiple of the {itemsize}-byte {self.dtype}; set "
                "state_content_bytes to a multiple of the element size"
            )
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"{name}.page_size_padded={self.page_size_padded} is smaller than the "
                f"page it pads ({self.real_page_size_bytes} bytes); pass at least "
                f"{self.real_page_size_bytes} or None"
            )

    @property
    def num_heads(self) -> int:
        return self.num_head_slots if self.num_head_slots is not None else self.num_kv_heads

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * self.dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    @property
    def view_dtype(self) -> torch.dtype:
        return self.dtype


@attrs.frozen
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context.

    ``sliding_window`` / ``attention_chunk_size`` record a merged layer's
    window when a model mixes them into full-attention groups.
    """

    sliding_window: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs_optional_positive
    )
    attention_chunk_size: int | None = attrs.field(
        default=None, kw_only=True, validator=attrs_optional_positive
    )


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

    head_size_v: int | None = attrs.field(
        default=0,
        kw_only=True,
        validator=attrs.validators.optional(attrs_non_negative),
    )


@attrs.frozen
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder attention: no KV cache pages are allocated."""


@attrs.frozen
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention of encoder-decoder models."""


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    try:
        shapes = [tuple(shape) for shape in value]
    except TypeError:
        raise TypeError(
            f"MambaSpec.shapes must be a sequence of shapes (e.g. [(4, 128), (8, 64)]), "
            f"got {value!r}"
        ) from None
    return tuple(
        tuple(as_int(f"MambaSpec.shapes[{i}] dim", d) for d in shape)
        for i, shape in enumerate(shapes)
    )


def _dtypes(value: Any) -> tuple[torch.dtype, ...]:
    if isinstance(value, torch.dtype):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(
            f"MambaSpec.dtypes must be a torch.dtype or a sequence of them, got {value!r}"
        ) from None


@attrs.frozen
class MambaSpec(KVCacheSpec):
    """A state cache (Mamba/SSM): one state per block holding several tensors.

    ``shapes[i]``/``dtypes[i]`` describe state tensor ``i``; the page is the sum
    of their bytes (or ``page_size_padded``). Views are ``[B, 1, 1, C]``.
    """

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_dtypes)
    page_size_padded: int | None = attrs.field(  # type: ignore[assignment]
        default=None, kw_only=True, validator=attrs_optional_positive
    )

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"{name} needs one dtype per state shape and at least one state, got "
                f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes"
            )
        for dtype in self.dtypes:
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{name}.dtypes must hold torch.dtype values, got {dtype!r}")
        for shape in self.shapes:
            if any(d <= 0 for d in shape):
                raise ValueError(f"{name}: state shape {shape} has a non-positive dim")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"{name}.page_size_padded={self.page_size_padded} is smaller than the "
                f"state bytes ({self.real_page_size_bytes}); pass at least that or None"
            )

    @property
    def tokens_per_state(self) -> int:
        return -1

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor, in order."""
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    @property
    def state_content_size_bytes(self) -> int:
        return sum(self.state_bytes)

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    @property
    def view_dtype(self) -> torch.dtype:
        """The common dtype of all states, or ``torch.int8`` when they differ."""
        first = self.dtypes[0]
        return first if all(d == first for d in self.dtypes) else torch.int8

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        positive_int("max_model_len", max_model_len)
        return 1

    def split_states(self, view: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[B, 1, 1, C]`` layer view into one ``[B, *shape]`` tensor per state.

        Each state must start at a byte offset (and the view's blocks at a
        stride) divisible by its element size, else ``ValueError``.
        """
        if not isinstance(view, torch.Tensor) or view.dim() != 4 or view.shape[1:3] != (1, 1):
            raise ValueError(
                f"split_states needs a [B, 1, 1, C] layer view, got "
                f"{tuple(view.shape) if isinstance(view, torch.Tensor) else view!r}"
            )
        raw = view.view(torch.int8) if view.dtype != torch.int8 else view
        raw = raw[:, 0, 0, :]
        if raw.shape[1] != self.state_content_size_bytes:
            raise ValueError(
                f"the view holds {raw.shape[1]} bytes per block, this spec's states "
                f"{self.state_content_size_bytes}; pass a view made for this spec"
            )
        out, start = [], 0
        for i, (shape, dtype, nbytes) in enumerate(zip(self.shapes, self.dtypes, self.state_bytes)):
            offset = raw.storage_offset() + start
            if offset % dtype.itemsize or raw.stride(0) % dtype.itemsize:
                raise ValueError(
                    f"state {i} ({dtype}) starts at byte {offset} with block stride "
                    f"{raw.stride(0)}, not multiples of {dtype.itemsize}; order the "
                    "states by decreasing element size or pad the page"
                )
            part = raw[:, start : start + nbytes].view(dtype)
            out.append(part.reshape(raw.shape[0], *shape))
            start += nbytes
        return out


def _spec_mapping(value: Any) -> dict[str, KVCacheSpec]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"UniformTypeKVCacheSpecs.kv_cache_specs must map layer names to specs, got {value!r}"
        )
    return dict(value)


@attrs.frozen
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One KV cache group whose layers differ in shape but share one spec type.

    The page of the group is the sum of its layers' pages.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = attrs.field(
        converter=_spec_mapping, hash=False
    )

    def __attrs_post_init__(self) -> None:
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec")
        for name, spec in self.kv_cache_specs.items():
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(
                    f"UniformTypeKVCacheSpecs: layer {name!r} maps to {spec!r}, not a KVCacheSpec"
                )
        kinds = {type(s) for s in self.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise ValueError(
                "UniformTypeKVCacheSpecs needs layers of one spec type, got "
                + ", ".join(sorted(k.__name__ for k in kinds))
            )
        for name, spec in self.kv_cache_specs.items():
            if spec.block_size != self.block_size:
                raise ValueError(
                    f"layer {name!r} has block size {spec.block_size}, the group "
                    f"has {self.block_size}; give every layer the same block size"
                )

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        specs = list(kv_cache_specs.values())
        return bool(specs) and all(
            type(s) is type(specs[0]) and s.block_size == specs[0].block_size for s in specs
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """Group ``kv_cache_specs`` when they share one type and block size, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size, kv_cache_specs)

    @property
    def tokens_per_state(self) -> int | Fraction:
        return next(iter(self.kv_cache_specs.values())).tokens_per_state

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def real_page_size_bytes(self) -> int:
        return sum(s.real_page_size_bytes for s in self.kv_cache_specs.values())

    def _page_of_tokens(self, tokens: int) -> int:
        return sum(s._page_of_tokens(tokens) for s in self.kv_cache_specs.values())

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size,
            {n: s.copy_with_new_block_size(block_size) for n, s in self.kv_cache_specs.items()},
        )

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return max(s.max_num_blocks_per_req(max_model_len) for s in self.kv_cache_specs.values())
