"""The six physical layouts of the logical ``[L, B, H, N, C]`` KV cache tensor, and its strides."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from kvcore._validate import non_negative_int, positive_int
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs

L, B, H, N, C = range(5)
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class KVCacheLayout(enum.Enum):
    """Physical order of the logical ``[L, B, H, N, C]`` dims, outermost first."""

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @classmethod
    def parse(cls, text: str | KVCacheLayout) -> KVCacheLayout:
        """A layout from its name (any case) or the legacy aliases NHD / HND."""
        if isinstance(text, KVCacheLayout):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a KV cache layout name must be a str, got {text!r}")
        key = text.strip().upper()
        try:
            return cls[_ALIASES.get(key, key)]
        except KeyError:
            valid = ", ".join([m.name for m in cls] + list(_ALIASES))
            raise ValueError(f"unknown KV cache layout {text!r}; valid names: {valid}") from None

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Logical dim indices (L=0 B=1 H=2 N=3 C=4), outermost first in memory."""
        return tuple("LBHNC".index(ch) for ch in self.value)

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """Dims of a layer's ``[B, H, N, C]`` view (B=0 .. C=3), outermost first in memory."""
        return tuple(d - 1 for d in self.stride_order if d != L)

    @property
    def is_layer_compact(self) -> bool:
        """L is outermost: each layer's cache is one contiguous region."""
        return self.value[0] == "L"

    @property
    def is_block_outermost(self) -> bool:
        """B is outermost: each block holds every layer's page."""
        return self.value[0] == "B"

    @property
    def is_block_compact(self) -> bool:
        """The first two dims are L and B: a (layer, block) page is one run."""
        return set(self.value[:2]) == {"L", "B"}

    @property
    def is_block_contiguous(self) -> bool:
        """H, N, C are innermost in that order: a (layer, block) page is ``[H, N, C]``."""
        return self.value[2:] == "HNC"


def split_ratio(block_size: int, kernel_block_size: int | None) -> int:
    """Kernel blocks per manager block (1 for None); ``ValueError`` unless it divides."""
    if kernel_block_size is None:
        return 1
    kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
    if block_size % kernel_block_size:
        raise ValueError(
            f"block size {block_size} is not divisible by kernel block size "
            f"{kernel_block_size}; pick a kernel block size that divides it"
        )
    return block_size // kernel_block_size


def kernel_extents(
    spec: KVCacheSpec, num_blocks: int, num_layers: int, kernel_block_size: int | None
) -> tuple[int, int, int, int, int]:
    """Extents of the kernel-granular ``[L, B, H, N, C]`` shape (B counts kernel blocks)."""
    ratio = split_ratio(spec.block_size, kernel_block_size)
    states = spec.get_num_kernel_states(kernel_block_size or spec.block_size)
    return (num_layers, num_blocks * ratio, spec.num_heads, states, spec.state_content_size_bytes)


def _fixed_strides(fixed_strides: Sequence[int | None]) -> tuple[int | None, ...]:
    try:
        fixed = tuple(fixed_strides)
    except TypeError:
        raise TypeError(f"fixed_strides must be 5 ints or Nones, got {fixed_strides!r}") from None
    if len(fixed) != 5:
        raise ValueError(f"fixed_strides needs 5 entries ([L, B, H, N, C]), got {len(fixed)}")
    return tuple(
        None if s is None else non_negative_int(f"fixed stride of {'LBHNC'[d]}", s)
        for d, s in enumerate(fixed)
    )


def compute_layout_strides(
    spec: KVCacheSpec,
    num_blocks: int,
    num_layers: int,
    layout: KVCacheLayout | str,
    kernel_block_size: int | None = None,
    fixed_strides: Sequence[int | None] = (None,) * 5,
) -> tuple[int, int, int, int, int]:
    """Byte strides of the logical ``[L, B, H, N, C]`` dims under ``layout`` (per-token-head scales follow
    the data rows of each :func:`scale_unit`)."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        raise ValueError(
            f"{type(spec).__name__} has no single [H, N, C] shape (layers "
            f"{list(spec.kv_cache_specs)}); compute strides with each layer's own "
            "spec (spec.kv_cache_specs[name])"
        )
    layout = KVCacheLayout.parse(layout)
    num_blocks = positive_int("num_blocks", num_blocks)
    num_layers = positive_int("num_layers", num_layers)
    fixed = _fixed_strides(fixed_strides)
    block_size, padded = spec.block_size, spec.page_size_padded
    ratio = split_ratio(block_size, kernel_block_size)
    if padded is not None and ratio > 1:
        raise ValueError(
            f"a padded page ({padded} bytes) cannot be split into {ratio} kernel "
            f"blocks of {kernel_block_size} tokens; use a manager block size of "
            f"{kernel_block_size} or an unpadded spec"
        )
    if ratio > 1 and spec.tokens_per_state <= 0:
        raise ValueError(
            f"{type(spec).__name__} keeps one state per block, so its {block_size}-token "
            f"blocks cannot be split into {kernel_block_size}-token kernel blocks; "
            f"use kernel_block_size={block_size} (or None)"
        )
    extents = kernel_extents(spec, num_blocks, num_layers, kernel_block_size)
    order = layout.stride_order
    # NOTE: the "page grid" is the physical dims down to the inner one of L and B.
    grid_end = max(order.index(L), order.index(B))
    grid_pages = math.prod(extents[d] for d in order[: grid_end + 1])
    if padded is not None and grid_pages != num_layers * num_blocks:
        raise ValueError(
            f"layout {layout.name} puts heads between layers and blocks, so a padded "
            f"page cannot be expressed for {spec.num_heads} heads; use a "
            "block-compact layout such as LBNHC or BLNHC"
        )
    strides = [0] * 5
    running = 1  # NOTE: bytes spanned by the dims inside the current one
    for pos in range(4, -1, -1):
        d = order[pos]
        if pos == grid_end:  # NOTE: a unit's scales (if any) follow its data rows
            running += running // extents[C] * spec.scale_size_bytes
        stride = fixed[d]
        if stride is None and padded is not None and pos == grid_end:
            stride = max(running, padded)
        elif stride is None:
            stride = running
        strides[d] = stride
        running = stride * extents[d]
    return tuple(strides)  # type: ignore[return-value]


def scale_unit(layout: KVCacheLayout) -> tuple[int, ...]:
    """Dims inside the inner of L and B: the unit whose data rows its scales follow (``[N, C]`` in BHLNC)."""
    order = layout.stride_order
    return order[max(order.index(L), order.index(B)) + 1 :]


def block_runs(
    shape: Sequence[int],
    byte_strides: Sequence[int],
    itemsize: int,
    rows_per_block: int = 1,
    *,
    max_runs: int | None = None,
) -> tuple[list[int], int]:
    """Offsets (from block 0's first byte) and common length of the contiguous runs that cover
    manager block 0 of a strided view once (dim 0: rows, ``rows_per_block`` of them a block)."""
    dims = [(n, s) for n, s in zip(shape[1:], byte_strides[1:]) if n > 1]
    if rows_per_block > 1:
        dims.append((rows_per_block, byte_strides[0]))
    dims.append((itemsize, 1))
    run, outer = 1, []
    for extent, stride in sorted(dims, key=lambda d: d[1]):
        if not outer and stride == run:
            run *= extent
        else:
            outer.append((extent, stride))
    count = math.prod(extent for extent, _ in outer)
    if max_runs is not None and count > max_runs:
        raise ValueError(
            f"a view of shape {tuple(shape)} and byte strides {tuple(byte_strides)} splits "
            f"into {count} runs per block; store each (head, state) contiguously"
        )
    offsets = [0]
    for extent, stride in outer:
        offsets = [o + i * stride for o in offsets for i in range(extent)]
    return offsets, run
