"""Plan a model's KV cache: groups, bytes per block, block count and tensors.

The memory model. One allocation of ``num_blocks * bytes_per_block`` bytes
backs every group; each group's tensor spans it from byte 0, and a block id
belongs to one group at a time, so block ``b`` of one group may share bytes
only with block ``b`` of another group.

- Layer-compact layouts (``L`` outermost): layer ``l`` of a group owns the
  region ``[l * num_blocks * s, (l + 1) * num_blocks * s)`` where ``s`` is the
  group's per-layer block stride ``round_up(page, alignment)``; block ``b``
  sits at ``b * s`` inside it. Groups with one ``s`` put block ``b`` of layer
  ``l`` at the same address, so they overlay safely; groups with different
  ``s`` would not (block ``b`` of one group would hit block ``2b`` of another),
  and are refused. ``bytes_per_block`` is the largest group's ``n_layers * s``.
  LHBNC additionally needs one head count and per-head block stride.
- Block-outermost layouts (``B`` outermost): block ``b`` owns the region
  ``[b * bytes_per_block, (b + 1) * bytes_per_block)`` and each group lays its
  layers' pages inside it, so any mix of pages overlays safely.
  ``bytes_per_block`` is the largest group's sum of pages, rounded up to the
  lcm of the block-stride alignments (and view element sizes).

A layout that cannot express the model's pages (padded multi-head pages in a
layout that puts heads between layers and blocks, different per-layer block
strides in a layer-compact layout, ...) is refused before the budget is
checked, and the error names the layouts that can: each candidate is tried
with a dry run, so a named layout really plans the model.

A ``UniformTypeKVCacheSpecs`` group holds layers of different shapes: each
distinct shape becomes one tensor, placed after the previous one (at a byte
offset in the allocation for layer-compact layouts, inside the block for
block-outermost layouts), those with the largest element size first so that
every tensor starts at a multiple of its element size. Every tensor is
checked as ``allocate_kv_cache`` will check it (aligned start and strides,
last byte inside the allocation), so an accepted plan allocates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from kvcore._units import format_bytes_exact
from kvcore._validate import non_negative_int, positive_int
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.memory.plan_groups import group_layers, is_encoder_only
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs

# NOTE: the order in which a refusal suggests the layouts that can plan a model
# (after those of the requested layout's family).
_PREFERRED = tuple(KVCacheLayout[n] for n in ("LBNHC", "BLNHC", "LBHNC", "BLHNC", "LHBNC", "BHLNC"))


# Block 0 is the null block, so a pool needs at least one more.
_MIN_BLOCKS = 2


class _Refusal(ValueError):
    """The layout cannot express the model's pages (internal; re-raised with a remedy)."""


@attrs.frozen
class _Part:
    """Layers of one group with one spec: they become one tensor."""

    group_id: int
    layers: tuple[str, ...]
    spec: KVCacheSpec
    stride: int  # bytes per layer per block (the page, rounded for layer-compact layouts)

    @property
    def footprint(self) -> int:
        return len(self.layers) * self.stride


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError(
            "kv_cache_specs must map layer names to specs in model order, got "
            f"{type(kv_cache_specs).__name__}"
        )
    if not kv_cache_specs:
        raise ValueError("kv_cache_specs is empty; describe at least one layer")
    for name, spec in kv_cache_specs.items():
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {name!r}")
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise TypeError(
                f"layer {name!r} needs a per-layer KVCacheSpec (e.g. FullAttentionSpec), "
                f"got {spec!r}"
            )
    return dict(kv_cache_specs)


def _parts(groups: list[KVCacheGroupSpec], layer_compact: bool) -> list[_Part]:
    parts = []
    for group_id, group in enumerate(groups):
        if is_encoder_only(group):
            continue
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(group.spec_of(name), []).append(name)
        # NOTE: parts of one group sit one after another; placing those with
        # the largest element size first keeps every part's start aligned
        # (element sizes are powers of two and each footprint is a multiple
        # of its own element size).
        ordered = sorted(by_spec.items(), key=lambda item: -item[0].dtype_alignment)
        for spec, names in ordered:
            stride = spec.page_size_bytes
            if layer_compact:
                stride = _round_up(stride, spec.get_block_stride_alignment())
            parts.append(_Part(group_id, tuple(names), spec, stride))
    return parts


def _bytes_per_block(parts: list[_Part], layout: KVCacheLayout) -> int:
    footprints: dict[int, int] = {}
    for part in parts:
        footprints[part.group_id] = footprints.get(part.group_id, 0) + part.footprint
    largest = max(footprints.values())
    if layout.is_layer_compact:
        if len(footprints) > 1 and len({p.stride for p in parts}) > 1:
            found = sorted({p.stride for p in parts})
            raise _Refusal(
                f"it keeps each layer's blocks together, so overlaid groups need one "
                f"per-layer block footprint, but this model's groups need {found} bytes"
            )
        return largest
    alignment = 1
    for part in parts:
        alignment = math.lcm(
            alignment, part.spec.get_block_stride_alignment(), part.spec.dtype_alignment
        )
    return _round_up(largest, alignment)


def _strides(part: _Part, layout: KVCacheLayout, num_blocks: int, bytes_per_block: int):
    if layout.is_block_outermost:
        fixed = (None, bytes_per_block, None, None, None)
    elif layout.is_block_compact:
        fixed = (None, part.stride, None, None, None)
    else:
        fixed = (None,) * 5
    spec, layer = part.spec, part.layers[0]
    if spec.page_size_padded is not None and spec.num_heads > 1 and not layout.is_block_compact:
        # NOTE: compute_layout_strides refuses this too; checking here keeps
        # its generic remedy out of the planner's message.
        raise _Refusal(
            f"it puts heads between layers and blocks, so layer {layer!r} cannot keep "
            f"its {spec.num_heads}-head page padded to {spec.page_size_padded} bytes"
        )
    try:
        strides = compute_layout_strides(
            spec, num_blocks, len(part.layers), layout, fixed_strides=fixed
        )
    except ValueError as exc:
        raise _Refusal(f"layer {layer!r} cannot be laid out ({exc})") from exc
    if layout.is_layer_compact and strides[0] != num_blocks * part.stride:
        raise _Refusal(
            f"it cannot give layer {layer!r} a block stride of {part.stride} bytes "
            "(its page rounded to the block-stride alignment)"
        )
    return strides


def _tensors(
    parts: list[_Part], layout: KVCacheLayout, num_blocks: int, bytes_per_block: int
) -> list[KVCacheTensor]:
    size = bytes_per_block * num_blocks
    tensors, offsets, heads = [], {}, {}
    overlaid = len({p.group_id for p in parts}) > 1
    for part in parts:
        strides = _strides(part, layout, num_blocks, bytes_per_block)
        if layout is KVCacheLayout.LHBNC and overlaid:
            # NOTE: in LHBNC a block is split across heads, so overlaid groups
            # must split it the same way.
            heads.setdefault((part.spec.num_heads, strides[1]), part.layers[0])
            if len(heads) > 1:
                raise _Refusal(
                    f"it splits blocks by head, and layers {list(heads.values())} split "
                    f"them differently (heads, block stride) = {list(heads)}"
                )
        offset = offsets.get(part.group_id, 0)
        extent = part.footprint * (num_blocks if layout.is_layer_compact else 1)
        offsets[part.group_id] = offset + extent
        _check_fits(part, strides, offset, num_blocks, size)
        tensors.append(KVCacheTensor(size, part.layers, strides[0], strides[1], offset))
    return tensors


def _check_fits(part: _Part, strides: tuple[int, ...], offset: int, num_blocks: int, size: int) -> None:
    """``_Refusal`` unless every layer's view starts aligned and ends inside the allocation.

    What ``allocate_kv_cache`` will demand of the tensor, checked here so that
    a layout the planner accepts (or names as able) really allocates.
    """
    spec, layer = part.spec, part.layers[0]
    align = spec.dtype_alignment
    itemsize = spec.view_dtype.itemsize
    if offset % align or strides[0] % align or strides[1] % align or any(s % itemsize for s in strides[2:4]):
        raise _Refusal(
            f"layer {layer!r} would start at byte {offset} with strides {strides}, not "
            f"multiples of its {align}-byte elements"
        )
    extents = (len(part.layers), num_blocks, spec.num_heads, spec.num_states, spec.state_content_size_bytes)
    end = offset + sum((n - 1) * st for n, st in zip(extents, strides)) + 1
    if end > size:
        raise _Refusal(
            f"layer {layer!r} would end at byte {end}, past the {size}-byte allocation"
        )


def _checked(groups: list[KVCacheGroupSpec], layout: KVCacheLayout) -> tuple[list[_Part], int]:
    """Parts and bytes per block under ``layout``; ``_Refusal`` if it cannot hold them."""
    parts = _parts(groups, layout.is_layer_compact)
    bytes_per_block = _bytes_per_block(parts, layout)
    _tensors(parts, layout, 2, bytes_per_block)  # a dry run: strides do not depend on the count
    return parts, bytes_per_block


def _refused(groups: list[KVCacheGroupSpec], layout: KVCacheLayout, reason: _Refusal) -> ValueError:
    """The error for a layout that cannot hold the model, naming the layouts that can."""
    family = sorted(_PREFERRED, key=lambda o: o.is_layer_compact != layout.is_layer_compact)
    able = []
    for other in family:
        if other is layout:
            continue
        try:
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


def plan_kv_cache(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    layout: KVCacheLayout | str,
    *,
    available_memory: int | None = None,
    num_blocks: int | None = None,
) -> KVCacheConfig:
    """Plan the KV cache of a model whose layers are ``kv_cache_specs`` (in model order).

    Give exactly one of ``available_memory`` (bytes; the most blocks that fit,
    at least 2) or ``num_blocks``. Groups come from
    :func:`kvcore.memory.plan_groups.group_layers`; every cache group gets one tensor
    per distinct layer spec, all of size ``bytes_per_block * num_blocks`` and
    overlaid from byte 0 (see the module docstring for the memory model).
    Raises ``ValueError`` when the budget holds fewer than 2 blocks or when
    ``layout`` cannot express the model's mixed pages (naming one that can).
    A model of encoder-only layers keeps no cache: it gets no tensors and
    ``num_blocks`` blocks, or 2 for any ``available_memory``.
    """
    layout = KVCacheLayout.parse(layout)
    specs = _check_specs(kv_cache_specs)
    if (available_memory is None) == (num_blocks is None):
        raise ValueError(
            "pass exactly one of available_memory (bytes) or num_blocks, got "
            f"available_memory={available_memory!r}, num_blocks={num_blocks!r}"
        )
    if num_blocks is not None:
        num_blocks = positive_int("num_blocks", num_blocks)
        if num_blocks < _MIN_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks} leaves no usable block (block 0 is the null block); "
                "plan at least 2 blocks"
            )
    else:
        available_memory = non_negative_int("available_memory", available_memory)

    groups = group_layers(specs)
    if all(is_encoder_only(g) for g in groups):
        # NOTE: encoder-only layers keep no cache, so no byte is allocated and
        # any budget (0 included) holds the pool's minimum: the null block and
        # one block.
        return KVCacheConfig(num_blocks or _MIN_BLOCKS, [], groups, layout)
    try:
        parts, bytes_per_block = _checked(groups, layout)
    except _Refusal as exc:  # NOTE: checked before the budget: the layout error is more useful
        raise _refused(groups, layout, exc) from None
    if num_blocks is None:
        num_blocks = available_memory // bytes_per_block
        if num_blocks < _MIN_BLOCKS:
            layers = f"{len(specs)} layer" + ("s" if len(specs) != 1 else "")
            raise ValueError(
                f"available_memory={format_bytes_exact(available_memory)} holds {num_blocks} KV cache "
                f"block{'s' if num_blocks != 1 else ''}; one block of the model's {layers} needs "
                f"{format_bytes_exact(bytes_per_block)} and a pool needs {_MIN_BLOCKS} (block 0 is the "
                f"null block), so plan with at least {format_bytes_exact(_MIN_BLOCKS * bytes_per_block)}, a "
                "smaller block size or a smaller model"
            )
    tensors = _tensors(parts, layout, num_blocks, bytes_per_block)
    return KVCacheConfig(num_blocks, tensors, groups, layout)
