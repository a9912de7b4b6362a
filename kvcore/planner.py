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

A ``UniformTypeKVCacheSpecs`` group holds layers of different shapes: each
distinct shape becomes one tensor, placed after the previous one (at a byte
offset in the allocation for layer-compact layouts, inside the block for
block-outermost layouts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from kvcore._validate import non_negative_int, positive_int
from kvcore.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.layout import KVCacheLayout, compute_layout_strides
from kvcore.plan_groups import group_layers, is_encoder_only
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs


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
        for spec, names in by_spec.items():
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
            raise ValueError(
                f"layout {layout.name} keeps each layer's blocks together, so overlaid "
                f"groups need one per-layer block footprint, but this model's groups "
                f"need {found} bytes; use a block-outermost layout such as BLNHC"
            )
        return largest
    alignment = 1
    for part in parts:
        alignment = math.lcm(
            alignment, part.spec.get_block_stride_alignment(), part.spec.view_dtype.itemsize
        )
    return _round_up(largest, alignment)


def _strides(part: _Part, layout: KVCacheLayout, num_blocks: int, bytes_per_block: int):
    if layout.is_block_outermost:
        fixed = (None, bytes_per_block, None, None, None)
    elif layout.is_block_compact:
        fixed = (None, part.stride, None, None, None)
    else:
        fixed = (None,) * 5
    try:
        strides = compute_layout_strides(
            part.spec, num_blocks, len(part.layers), layout, fixed_strides=fixed
        )
    except ValueError as exc:
        raise ValueError(f"cannot lay out layer {part.layers[0]!r}: {exc}") from exc
    if layout.is_layer_compact and strides[0] != num_blocks * part.stride:
        raise ValueError(
            f"layout {layout.name} cannot give layer {part.layers[0]!r} a block stride "
            f"of {part.stride} bytes (its page rounded to the block-stride alignment); "
            "use a block-compact layout such as LBNHC"
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
                raise ValueError(
                    f"layout LHBNC splits blocks by head, and layers {list(heads.values())} "
                    "split them differently (heads, block stride) = "
                    f"{list(heads)}; use a block-compact layout such as LBNHC"
                )
        offset = offsets.get(part.group_id, 0)
        extent = part.footprint * (num_blocks if layout.is_layer_compact else 1)
        offsets[part.group_id] = offset + extent
        tensors.append(KVCacheTensor(size, part.layers, strides[0], strides[1], offset))
    return tensors


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
    :func:`kvcore.plan_groups.group_layers`; every cache group gets one tensor
    per distinct layer spec, all of size ``bytes_per_block * num_blocks`` and
    overlaid from byte 0 (see the module docstring for the memory model).
    Raises ``ValueError`` when the budget holds fewer than 2 blocks or when
    ``layout`` cannot express the model's mixed pages (naming one that can).
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
    else:
        available_memory = non_negative_int("available_memory", available_memory)

    groups = group_layers(specs)
    parts = _parts(groups, layout.is_layer_compact)
    if not parts:  # only encoder-only layers: nothing to allocate
        return KVCacheConfig(num_blocks or 1, [], groups, layout)
    bytes_per_block = _bytes_per_block(parts, layout)
    if num_blocks is None:
        num_blocks = available_memory // bytes_per_block
        if num_blocks < 2:
            # NOTE: a layout that cannot hold the model is the more useful error.
            _tensors(parts, layout, 2, bytes_per_block)
            raise ValueError(
                f"available_memory={available_memory} bytes holds {num_blocks} KV cache "
                f"block(s); one block of all {len(specs)} layers needs {bytes_per_block} "
                f"bytes, so plan with at least {2 * bytes_per_block} bytes, a smaller "
                "block size or a smaller model"
            )
    tensors = _tensors(parts, layout, num_blocks, bytes_per_block)
    return KVCacheConfig(num_blocks, tensors, groups, layout)
