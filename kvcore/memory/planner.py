"""Plan a model's KV cache (SPEC §6): groups, bytes per block, block count and tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import torch

from kvcore._units import format_bytes_exact
from kvcore._validate import non_negative_int, positive_int
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, is_state_spec
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides, round_up
from kvcore.memory.views import create_kv_cache_views
from kvcore.specs import KVCacheSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from kvcore.specs.base import check_hashable

# NOTE: the order in which a refusal names the layouts that can plan a model.
_PREFERRED = tuple(KVCacheLayout[n] for n in ("LBNHC", "BLNHC", "LBHNC", "BLHNC", "LHBNC", "BHLNC"))
_MIN_BLOCKS = 2  # block 0 is the null block, so a pool needs one more
#: Where the region after a separate state region starts: a multiple of this many bytes.
REGION_ALIGNMENT = 4096


class _Refusal(ValueError):
    """The layout cannot express the model's pages (re-raised naming layouts that can)."""


def is_encoder_only(group: KVCacheGroupSpec) -> bool:
    """Whether a group's layers keep no KV cache."""
    return not group.kv_cache_spec.has_cache_pages


def _paddable(spec: KVCacheSpec) -> bool:
    return attrs.has(type(spec)) and "page_size_padded" in attrs.fields_dict(type(spec))


def _unify_page_size(spec: KVCacheSpec, page: int, layer_name: str) -> KVCacheSpec:
    """``spec`` grown (a larger block size) or padded so that its page is ``page`` bytes."""
    current = spec.page_size_bytes
    if current == page:
        return spec
    if page % current == 0 and spec.page_size_padded is None:
        scaled = spec.copy_with_new_block_size(spec.block_size * (page // current))
        if scaled.page_size_bytes == page:  # NOTE: a state cache's page does not grow
            return scaled
    mla = isinstance(spec, MLAAttentionSpec)
    if mla or not _paddable(spec):
        raise ValueError(
            f"{'MLA ' if mla else ''}layer {layer_name!r} ({type(spec).__name__}) has a "
            f"{current}-byte page (block size {spec.block_size}) that does not divide the "
            f"model's common page of {page} bytes (the largest page, rounded up to a multiple "
            f"of every element size), and {'MLA' if mla else 'its'} pages cannot be padded; "
            "choose block sizes whose pages divide the largest page"
        )
    return attrs.evolve(spec, page_size_padded=page)


def _cache_groups(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    for name, spec in specs.items():
        page, align = spec.page_size_bytes, spec.dtype_alignment
        if page % align and _paddable(spec):  # NOTE: a state cache of mixed dtypes
            specs[name] = attrs.evolve(spec, page_size_padded=round_up(page, align))
    distinct = list(dict.fromkeys(specs.values()))
    if len(distinct) == 1:
        return [KVCacheGroupSpec(list(specs), distinct[0])]
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [KVCacheGroupSpec(list(specs), uniform)]
    align = math.lcm(*(s.dtype_alignment for s in distinct))
    page = round_up(max(s.page_size_bytes for s in distinct), align)
    first_layer = {spec: name for name, spec in reversed(specs.items())}
    unified = {s: _unify_page_size(s, page, first_layer[s]) for s in distinct}
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(unified[spec], []).append(name)
    size = min(len(names) for names in by_spec.values())
    return [
        KVCacheGroupSpec(names[start : start + size], spec)
        for spec, names in by_spec.items()
        for start in range(0, len(names), size)
    ]


def group_layers(kv_cache_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """KV cache groups of a model, in model order (SPEC §6); encoder-only groups last."""
    cached = {n: s for n, s in kv_cache_specs.items() if s.has_cache_pages}
    encoder: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        if not spec.has_cache_pages:
            encoder.setdefault(spec, []).append(name)
    groups = _cache_groups(cached) if cached else []
    return groups + [KVCacheGroupSpec(names, spec) for spec, names in encoder.items()]


@attrs.frozen
class _Part:
    """Layers of one group with one spec: they become one tensor."""

    group_id: int
    layers: tuple[str, ...]
    spec: KVCacheSpec
    stride: int  # bytes per layer per block (the page, rounded for layer-compact layouts)

    @property
    def footprint(self) -> int:
        """Bytes of all the part's layers in one block."""
        return len(self.layers) * self.stride


def _parts(groups: list[KVCacheGroupSpec], layer_compact: bool) -> list[_Part]:
    parts = []
    for group_id, group in enumerate(groups):
        if is_encoder_only(group):
            continue
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(group.spec_of(name), []).append(name)
        # NOTE: largest element size first keeps every part's start aligned (element
        # sizes are powers of two and each footprint is a multiple of its own).
        for spec, names in sorted(by_spec.items(), key=lambda item: -item[0].dtype_alignment):
            stride = spec.page_size_bytes
            if layer_compact:
                stride = round_up(stride, spec.get_block_stride_alignment())
            parts.append(_Part(group_id, tuple(names), spec, stride))
    return parts


def _bytes_per_block(parts: list[_Part], layout: KVCacheLayout) -> int:
    footprints: dict[int, int] = {}
    for part in parts:
        footprints[part.group_id] = footprints.get(part.group_id, 0) + part.footprint
    largest = max(footprints.values())
    if not layout.is_layer_compact:
        specs = [p.spec for p in parts]
        alignments = [a for s in specs for a in (s.get_block_stride_alignment(), s.dtype_alignment)]
        return round_up(largest, math.lcm(*alignments))
    strides = sorted({p.stride for p in parts})
    if len(footprints) > 1 and len(strides) > 1:
        raise _Refusal(
            f"it keeps each layer's blocks together, so overlaid groups need one "
            f"per-layer block footprint, but this model's groups need {strides} bytes"
        )
    return largest


def _strides(part: _Part, layout: KVCacheLayout, num_blocks: int, bytes_per_block: int):
    fixed = [None] * 5
    if layout.is_block_outermost:
        fixed[1] = bytes_per_block
    elif layout.is_block_compact:
        fixed[1] = part.stride
    spec, layer = part.spec, part.layers[0]
    if spec.page_size_padded is not None and spec.num_heads > 1 and not layout.is_block_compact:
        # NOTE: the one refusal compute_layout_strides could make here, naming the layer.
        raise _Refusal(
            f"it puts heads between layers and blocks, so layer {layer!r} cannot keep "
            f"its {spec.num_heads}-head page padded to {spec.page_size_padded} bytes"
        )
    strides = compute_layout_strides(spec, num_blocks, len(part.layers), layout, None, fixed)
    if layout.is_layer_compact and strides[0] != num_blocks * part.stride:
        raise _Refusal(
            f"it cannot give layer {layer!r} a block stride of {part.stride} bytes "
            "(its page rounded to the block-stride alignment)"
        )
    return strides


def _tensors(
    parts: list[_Part], layout: KVCacheLayout, num_blocks: int, bytes_per_block: int,
    base: int = 0, size: int | None = None,
) -> list[KVCacheTensor]:
    """One tensor per part, each viewed once over a meta buffer (``_Refusal`` if it cannot be);
    the region starts at byte ``base`` of a ``size``-byte allocation (default: just the region)."""
    size = base + bytes_per_block * num_blocks if size is None else size
    meta = torch.empty(size, dtype=torch.int8, device="meta")
    tensors, offsets, heads = [], {}, {}
    overlaid = len({p.group_id for p in parts}) > 1
    for part in parts:
        strides = _strides(part, layout, num_blocks, bytes_per_block)
        if layout is KVCacheLayout.LHBNC and overlaid:
            # NOTE: in LHBNC a block is split across heads; overlaid groups must split it alike.
            heads.setdefault((part.spec.num_heads, strides[1]), part.layers[0])
            if len(heads) > 1:
                raise _Refusal(
                    f"it splits blocks by head, and layers {list(heads.values())} split "
                    f"them differently (heads, block stride) = {list(heads)}"
                )
        offset = base + offsets.get(part.group_id, 0)
        blocks = num_blocks if layout.is_layer_compact else 1
        offsets[part.group_id] = offset - base + part.footprint * blocks
        tensor = KVCacheTensor(size, part.layers, strides[0], strides[1], offset)
        if part.spec.has_layer_views:
            try:
                create_kv_cache_views(meta, part.spec, num_blocks, layout, tensor)
            except ValueError as exc:
                raise _Refusal(f"layer {part.layers[0]!r} cannot be viewed ({exc})") from exc
        tensors.append(tensor)
    return tensors


def _checked(groups: list[KVCacheGroupSpec], layout: KVCacheLayout) -> tuple[list[_Part], int]:
    """Parts and bytes per block under ``layout`` after a dry run; ``_Refusal`` if it fails."""
    parts = _parts(groups, layout.is_layer_compact)
    bytes_per_block = _bytes_per_block(parts, layout)
    _tensors(parts, layout, _MIN_BLOCKS, bytes_per_block)
    return parts, bytes_per_block


def _refused(
    regions: list[list[KVCacheGroupSpec]], layout: KVCacheLayout, reason: _Refusal
) -> ValueError:
    """The error for a layout that cannot hold the model, naming those that pass a dry run."""
    family = sorted(_PREFERRED, key=lambda o: o.is_layer_compact != layout.is_layer_compact)
    able = []
    for other in family:
        if other is layout:
            continue
        try:
            for groups in regions:
                _checked(groups, other)
        except _Refusal:
            continue
        able.append(other.name)
    remedy = (
        f"use a layout that can, such as {able[0]} (all that can: {', '.join(able)})"
        if able
        else "no layout can, so change the layers' block sizes or head counts"
    )
    return ValueError(f"layout {layout.name} cannot hold this model's pages: {reason}; {remedy}")


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError(
            "kv_cache_specs must map layer names to specs in model order, got "
            f"{type(kv_cache_specs).__name__}"
        )
    if not kv_cache_specs:
        raise ValueError("kv_cache_specs is empty; describe at least one layer")
    for name, spec in kv_cache_specs.items():  # NOTE: KVCacheGroupSpec checks the names
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise TypeError(
                f"layer {name!r} needs a per-layer KVCacheSpec (e.g. FullAttentionSpec), "
                f"got {spec!r}"
            )
        check_hashable(f"the spec of layer {name!r}", spec)
    return dict(kv_cache_specs)


def plan_kv_cache(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    layout: KVCacheLayout | str,
    *,
    available_memory: int | None = None,
    num_blocks: int | None = None,
    separate_state_pages: bool = False,
    num_state_blocks: int | None = None,
) -> KVCacheConfig:
    """Plan the KV cache of a model whose layers are ``kv_cache_specs`` (in model order), with
    exactly one of ``available_memory`` (bytes) or ``num_blocks``; an encoder-only model gets no
    tensors and ``num_blocks`` blocks (2 for any budget).

    ``separate_state_pages=True``: state caches get a region of their own at the start of the
    allocation, ``num_state_blocks`` blocks (the null block included) of their natural page;
    the other layers keep their own pages, and ``available_memory`` / ``num_blocks`` size their
    pool after that region.
    """
    layout = KVCacheLayout.parse(layout)
    specs = _check_specs(kv_cache_specs)
    if not isinstance(separate_state_pages, bool):
        raise TypeError(f"separate_state_pages must be True or False, got {separate_state_pages!r}")
    states = {n: s for n, s in specs.items() if is_state_spec(s)} if separate_state_pages else {}
    if num_state_blocks is not None and not states:
        raise ValueError(
            f"num_state_blocks={num_state_blocks!r} sizes a separate state region, which this plan "
            "has none of; pass separate_state_pages=True for a model with state caches, or drop it"
        )
    if (available_memory is None) == (num_blocks is None):
        raise ValueError(
            "pass exactly one of available_memory (bytes) or num_blocks, got "
            f"available_memory={available_memory!r}, num_blocks={num_blocks!r}"
        )
    if num_blocks is None:
        available_memory = non_negative_int("available_memory", available_memory)
    else:
        num_blocks = positive_int("num_blocks", num_blocks)
        if num_blocks < _MIN_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks} leaves no usable block (block 0 is the null block); "
                "plan at least 2 blocks"
            )
    if states:
        return _plan_separate(specs, states, layout, available_memory, num_blocks, num_state_blocks)
    groups = group_layers(specs)
    if all(is_encoder_only(g) for g in groups):
        # NOTE: no byte is allocated, so any budget (0 included) holds the minimum pool.
        return KVCacheConfig(num_blocks or _MIN_BLOCKS, [], groups, layout)
    try:
        parts, bytes_per_block = _checked(groups, layout)
    except _Refusal as exc:  # NOTE: checked before the budget: the layout error is more useful
        raise _refused([groups], layout, exc) from None
    num_blocks = _budget_blocks(specs, bytes_per_block, available_memory, num_blocks)
    tensors = _tensors(parts, layout, num_blocks, bytes_per_block)
    return KVCacheConfig(num_blocks, tensors, groups, layout)


def _budget_blocks(
    specs: dict[str, KVCacheSpec], bytes_per_block: int, available_memory: int | None,
    num_blocks: int | None, reserved: int = 0,
) -> int:
    """``num_blocks``, or the blocks ``available_memory`` buys after ``reserved`` bytes."""
    if num_blocks is None:
        num_blocks = max(available_memory - reserved, 0) // bytes_per_block
        if num_blocks < _MIN_BLOCKS:
            layers = f"{len(specs)} layer" + ("s" if len(specs) != 1 else "")
            need = format_bytes_exact(reserved + _MIN_BLOCKS * bytes_per_block)
            region = f" after the {format_bytes_exact(reserved)} state region" if reserved else ""
            raise ValueError(
                f"available_memory={format_bytes_exact(available_memory)} holds {num_blocks} "
                f"KV cache block{'s' if num_blocks != 1 else ''}{region}; one block of the model's "
                f"{layers} needs {format_bytes_exact(bytes_per_block)} and a pool needs "
                f"{_MIN_BLOCKS} (block 0 is the null block), so plan with at least {need}, "
                "a smaller block size or a smaller model"
            )
    return num_blocks


def _plan_separate(
    specs: dict[str, KVCacheSpec], states: dict[str, KVCacheSpec], layout: KVCacheLayout,
    available_memory: int | None, num_blocks: int | None, num_state_blocks: int | None,
) -> KVCacheConfig:
    """A plan whose state groups have a region of their own, ``num_state_blocks`` blocks first."""
    if num_state_blocks is None or positive_int("num_state_blocks", num_state_blocks) < _MIN_BLOCKS:
        raise ValueError(f"separate_state_pages=True needs num_state_blocks >= 2 (a slot per sequence and "
                         f"state group, and the null block), got {num_state_blocks!r}")
    others = group_layers({n: s for n, s in specs.items() if n not in states})
    cached = [g for g in others if not is_encoder_only(g)]
    if not cached:
        raise ValueError("separate_state_pages=True needs at least one layer beside the state caches; "
                         "plan a model of state caches alone with separate_state_pages=False")
    state_groups = _cache_groups(dict(states))
    try:
        state_parts, state_bytes = _checked(state_groups, layout)
        parts, bytes_per_block = _checked(cached, layout)
    except _Refusal as exc:
        raise _refused([state_groups, cached], layout, exc) from None
    region = round_up(state_bytes * num_state_blocks, REGION_ALIGNMENT)
    num_blocks = _budget_blocks(specs, bytes_per_block, available_memory, num_blocks, region)
    size = region + bytes_per_block * num_blocks
    tensors = _tensors(state_parts, layout, num_state_blocks, state_bytes, 0, size)
    tensors += _tensors(parts, layout, num_blocks, bytes_per_block, region, size)
    groups = cached + state_groups + [g for g in others if is_encoder_only(g)]
    return KVCacheConfig(num_blocks, tensors, groups, layout, num_state_blocks=num_state_blocks)
