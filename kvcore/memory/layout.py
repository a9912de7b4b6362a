"""The six physical layouts of the logical ``[L, B, H, N, C]`` KV cache tensor, which of them a
set of workers and specs may use, and the tensor's strides."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvcore._validate import non_negative_int, positive_int
from kvcore.settings import Settings
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


#: The layout used when no worker states a preference.
DEFAULT_LAYOUT = KVCacheLayout.LBNHC
LAYOUT_ENV = "KVCORE_KV_CACHE_LAYOUT"


def _names(layouts: Iterable[KVCacheLayout]) -> str:
    return "[" + ", ".join(layout.name for layout in layouts) + "]"


def parse_layouts(value: Any) -> list[KVCacheLayout]:
    """A list of layouts (members or names), duplicates dropped, order kept."""
    if isinstance(value, (str, KVCacheLayout)) or not isinstance(value, Iterable):
        raise TypeError(f"expected a list of KV cache layouts, got {value!r}")
    out = list(dict.fromkeys(KVCacheLayout.parse(item) for item in value))
    if not out:
        raise ValueError("expected at least one layout (return None to accept any)")
    return out


def requested_layout(requested: KVCacheLayout | str | None, settings: Settings) -> KVCacheLayout | None:
    """An explicit layout: ``requested``, else the settings' ``KVCORE_KV_CACHE_LAYOUT``, else None."""
    if requested is not None:
        return KVCacheLayout.parse(requested)
    try:
        return None if settings.kv_cache_layout is None else KVCacheLayout.parse(settings.kv_cache_layout)
    except ValueError as exc:
        raise ValueError(f"{LAYOUT_ENV}={settings.kv_cache_layout!r}: {exc}; fix or unset {LAYOUT_ENV}") from None


def layout_candidates(supported: Sequence[Sequence[KVCacheLayout | str] | None],
                      specs: Iterable[KVCacheSpec] | Mapping[str, KVCacheSpec] = ()) -> list[KVCacheLayout]:
    """The layouts every worker of ``supported`` takes (one list per worker, most preferred first;
    None: any), in the first choosy worker's order: only block-compact ones when ``specs`` differ
    in (heads, states, page bytes); LBNHC first when no worker states a preference."""
    workers = [parse_layouts(w) for w in supported if w is not None] or [list(KVCacheLayout)]
    candidates = [layout for layout in workers[0] if all(layout in w for w in workers[1:])]
    if not candidates:
        raise ValueError(
            "workers support no common KV cache layout: "
            + "; ".join(f"worker {i}: {_names(w)}" for i, w in enumerate(workers))
            + ". Use backends that share a layout on every worker."
        )
    flat: list[KVCacheSpec] = []
    for spec in specs.values() if isinstance(specs, Mapping) else specs:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"specs must hold KVCacheSpec objects, got {spec!r}")
        is_uniform = isinstance(spec, UniformTypeKVCacheSpecs)
        flat += spec.kv_cache_specs.values() if is_uniform else [spec]
    shapes = {(s.num_heads, s.num_states, s.page_size_bytes) for s in flat if s.has_layer_views and s.has_cache_pages}
    if len(shapes) > 1:
        compact = [layout for layout in candidates if layout.is_block_compact]
        if not compact:
            raise ValueError("layers with different (heads, states, page bytes) "
                             f"{sorted(shapes)} need a block-compact layout (LBNHC, LBHNC, BLNHC "
                             f"or BLHNC), but the workers only support {_names(candidates)}")
        candidates = compact
    if all(w is None for w in supported) and DEFAULT_LAYOUT in candidates:
        candidates.remove(DEFAULT_LAYOUT)
        candidates.insert(0, DEFAULT_LAYOUT)
    return candidates


def resolve_kv_cache_layout(supported: Sequence[Sequence[KVCacheLayout | str] | None],
                            specs: Iterable[KVCacheSpec] | Mapping[str, KVCacheSpec] = (),
                            requested: KVCacheLayout | str | None = None) -> KVCacheLayout:
    """The layout to allocate with.

    ``supported`` holds one list per worker, most preferred first (None: any layout). An explicit
    request (``requested``, else ``KVCORE_KV_CACHE_LAYOUT``) must be one of
    :func:`layout_candidates`; otherwise the first candidate wins, as vLLM resolves it.
    """
    candidates = layout_candidates(supported, specs)
    layout = requested_layout(requested, Settings.from_env() if requested is None else Settings())
    return candidates[0] if layout is None else checked_request(layout, candidates)


def checked_request(layout: KVCacheLayout, candidates: Sequence[KVCacheLayout]) -> KVCacheLayout:
    """``layout``, refused unless it is one of ``candidates``."""
    if layout not in candidates:
        raise ValueError(f"requested KV cache layout {layout.name} is not usable here; candidates: "
                         f"{_names(candidates)}. Request one of them (argument or {LAYOUT_ENV})")
    return layout


def split_ratio(block_size: int, kernel_block_size: int | None) -> int:
    """Kernel blocks per manager block (1 for None); ``ValueError`` unless it divides."""
    if kernel_block_size is None:
        return 1
    kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
    if block_size % kernel_block_size:
        raise ValueError(f"block size {block_size} is not divisible by kernel block size "
                         f"{kernel_block_size}; pick a kernel block size that divides it")
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
    """Byte strides of the logical ``[L, B, H, N, C]`` dims under ``layout``: a dim's stride is its
    fixed value if given, else the bytes of the dims inside it (raised to the padded page at the
    inner one of L and B; per-token-head scales follow the data rows of each :func:`scale_unit`)."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        raise ValueError(f"{type(spec).__name__} has no single [H, N, C] shape (layers {list(spec.kv_cache_specs)}); "
                         "compute strides with each layer's own spec (spec.kv_cache_specs[name])")
    layout = KVCacheLayout.parse(layout)
    num_blocks = positive_int("num_blocks", num_blocks)
    num_layers = positive_int("num_layers", num_layers)
    fixed = _fixed_strides(fixed_strides)
    block_size, padded = spec.block_size, spec.page_size_padded
    ratio = split_ratio(block_size, kernel_block_size)
    if padded is not None and ratio > 1:
        raise ValueError(f"a padded page ({padded} bytes) cannot be split into {ratio} "
                         f"kernel blocks of {kernel_block_size} tokens; use a manager "
                         f"block size of {kernel_block_size} or an unpadded spec")
    if ratio > 1 and spec.tokens_per_state <= 0:
        raise ValueError(f"{type(spec).__name__} keeps one state per block, so its "
                         f"{block_size}-token blocks cannot be split into {kernel_block_size}-token "
                         f"kernel blocks; use kernel_block_size={block_size} (or None)")
    extents = kernel_extents(spec, num_blocks, num_layers, kernel_block_size)
    order = layout.stride_order
    # NOTE: the "page grid" is the physical dims down to the inner one of L and B.
    grid_end = max(order.index(L), order.index(B))
    grid_pages = math.prod(extents[d] for d in order[: grid_end + 1])
    if padded is not None and grid_pages != num_layers * num_blocks:
        raise ValueError(f"layout {layout.name} puts heads between layers and blocks, so a padded page cannot be "
                         f"expressed for {spec.num_heads} heads; use a block-compact layout such as LBNHC or BLNHC")
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


def block_runs(shape: Sequence[int], byte_strides: Sequence[int], itemsize: int, rows_per_block: int = 1, *,
               max_runs: int | None = None) -> tuple[list[int], int]:
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
        raise ValueError(f"a view of shape {tuple(shape)} and byte strides {tuple(byte_strides)} "
                         f"splits into {count} runs per block; store each (head, state) contiguously")
    offsets = [0]
    for extent, stride in outer:
        offsets = [o + i * stride for o in offsets for i in range(extent)]
    return offsets, run


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ranges covering the same bytes; touching ranges are joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
