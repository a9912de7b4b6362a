"""A model's KV cache groups (page sizes unified to the largest) and their pages laid out as
tensors over one allocation: the parts of a plan before its block count is chosen."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvcore._units import format_bytes_exact
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, is_state_spec
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides, round_up
from kvcore.memory.views import create_kv_cache_views
from kvcore.specs import KVCacheSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs


class _Refusal(ValueError):
    """The layout cannot express the model's pages (re-raised naming layouts that can)."""


def check_hashable(where: str, spec: Any) -> None:
    """Refuse a spec that cannot be a dict key: layers are grouped by equal specs."""
    try:
        hash(spec)
    except TypeError as exc:
        raise TypeError(f"{where} ({type(spec).__name__}) cannot be hashed ({exc}); "
                        "kvcore groups layers by equal specs: declare the spec class with "
                        "@attrs.frozen and immutable fields (tuples, not lists)") from None


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
        raise ValueError(f"{'MLA ' if mla else ''}layer {layer_name!r} ({type(spec).__name__}) has a "
                         f"{current}-byte page (block size {spec.block_size}) that does not divide the "
                         f"model's common page of {page} bytes (the largest page, rounded up to a multiple "
                         f"of every element size), and {'MLA' if mla else 'its'} pages cannot be padded; "
                         "choose block sizes whose pages divide the largest page")
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
    """KV cache groups of a model, in model order (page sizes unified to the largest); encoder-only
    groups last."""
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
        raise _Refusal(f"it keeps each layer's blocks together, so overlaid groups need one "
                       f"per-layer block footprint, but this model's groups need {strides} bytes")
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
        raise _Refusal(f"it puts heads between layers and blocks, so layer {layer!r} cannot keep "
                       f"its {spec.num_heads}-head page padded to {spec.page_size_padded} bytes")
    strides = compute_layout_strides(spec, num_blocks, len(part.layers), layout, None, fixed)
    if layout.is_layer_compact and strides[0] != num_blocks * part.stride:
        raise _Refusal(f"it cannot give layer {layer!r} a block stride of {part.stride} bytes "
                       "(its page rounded to the block-stride alignment)")
    return strides


def _tensors(
    parts: list[_Part], layout: KVCacheLayout, num_blocks: int, bytes_per_block: int, base: int = 0,
    size: int | None = None,
) -> list[KVCacheTensor]:
    """One tensor per part, each viewed once over a meta buffer (``_Refusal`` if it cannot be); the
    parts start at byte ``base`` of a ``size``-byte allocation (default: just theirs)."""
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
                raise _Refusal(f"it splits blocks by head, and layers {list(heads.values())} split "
                               f"them differently (heads, block stride) = {list(heads)}")
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


# NOTE: the order in which a refusal names the layouts that can plan a model.
_PREFERRED = tuple(KVCacheLayout[n] for n in ("LBNHC", "BLNHC", "LBHNC", "BLHNC", "LHBNC", "BHLNC"))
MIN_BLOCKS = 2  # block 0 is the null block, so a pool needs one more
#: Where the layers after a separate state region start: a multiple of this many bytes.
REGION_ALIGNMENT = 4096


def _refused(groups: list[KVCacheGroupSpec], layout: KVCacheLayout, reason: str, regions: bool = False
             ) -> ValueError:
    """The error for a layout that cannot hold the model, naming those that can (``regions``: the
    state groups in a region of their own)."""
    family = sorted(_PREFERRED, key=lambda o: o.is_layer_compact != layout.is_layer_compact)
    apart = [[g for g in groups if g.kv_cache_spec.has_cache_pages and is_state_spec(g.kv_cache_spec) == side]
             for side in (True, False)] if regions else [groups]
    able = [o.name for o in family if o is not layout and all(lay_groups(part, o).refusal is None for part in apart)]
    remedy = (
        f"use a layout that can, such as {able[0]} (all that can: {', '.join(able)})"
        if able
        else "no layout can, so change the layers' block sizes or head counts"
    )
    return ValueError(f"layout {layout.name} cannot hold this model's pages: {reason}; {remedy}")


@attrs.frozen
class PagePlan:
    """A model's pages laid out in one layout, before the block count is chosen; ``refusal`` says
    why the layout cannot hold them (None: it can)."""

    groups: list[KVCacheGroupSpec]
    layout: KVCacheLayout
    parts: list[_Part]
    bytes_per_block: int
    refusal: str | None = None
    #: A separate state region first: its pages and blocks (the null block included).
    states: PagePlan | None = None
    num_state_blocks: int | None = None

    @property
    def region(self) -> int:
        """Bytes before the other layers' blocks: the state region's, rounded up."""
        return round_up(self.states.bytes_per_block * self.num_state_blocks, REGION_ALIGNMENT) if self.states else 0

    def error(self) -> ValueError:
        """The refusal as the error to raise, naming the layouts that can hold the model."""
        return _refused(self.groups, self.layout, self.refusal, self.states is not None)

    def blocks_for(self, available_memory: int) -> int | str:
        """Blocks ``available_memory`` bytes hold (2 when nothing is allocated) after the state
        region, or why too few."""
        left = max(available_memory - self.region, 0)
        num_blocks = left // self.bytes_per_block if self.parts else MIN_BLOCKS
        if num_blocks >= MIN_BLOCKS:
            return num_blocks
        count = sum(len(g.layer_names) for g in self.groups)
        layers = f"{count} layer" + ("s" if count != 1 else "")
        need = format_bytes_exact(self.region + MIN_BLOCKS * self.bytes_per_block)
        region = f" after the {format_bytes_exact(self.region)} state region" if self.states else ""
        return (f"available_memory={format_bytes_exact(available_memory)} holds {num_blocks} "
                f"KV cache block{'s' if num_blocks != 1 else ''}{region}; one block of the model's "
                f"{layers} needs {format_bytes_exact(self.bytes_per_block)} and a pool needs "
                f"{MIN_BLOCKS} (block 0 is the null block), so plan with at least {need}, "
                "a smaller block size or a smaller model")

    def place(self, num_blocks: int) -> KVCacheConfig:
        """The plan of ``num_blocks`` blocks."""
        if not self.parts:  # NOTE: no byte is allocated: any budget holds the minimum pool
            return KVCacheConfig(num_blocks, [], self.groups, self.layout)
        region, size = self.region, self.region + self.bytes_per_block * num_blocks
        tensors = [] if self.states is None else _tensors(
            self.states.parts, self.layout, self.num_state_blocks, self.states.bytes_per_block, 0, size)
        tensors += _tensors(self.parts, self.layout, num_blocks, self.bytes_per_block, region, size)
        return KVCacheConfig(num_blocks, tensors, self.groups, self.layout, num_state_blocks=self.num_state_blocks)


def lay_groups(groups: list[KVCacheGroupSpec], layout: KVCacheLayout) -> PagePlan:
    """``groups``' pages laid out in ``layout`` (refused as a value, with the reason)."""
    if all(is_encoder_only(g) for g in groups):
        return PagePlan(groups, layout, [], 0)
    parts = _parts(groups, layout.is_layer_compact)
    try:
        bytes_per_block = _bytes_per_block(parts, layout)
        _tensors(parts, layout, MIN_BLOCKS, bytes_per_block)  # NOTE: a dry run of the views
    except _Refusal as exc:  # NOTE: the one place a refusal becomes a value
        return PagePlan(groups, layout, parts, 0, str(exc))
    return PagePlan(groups, layout, parts, bytes_per_block)
