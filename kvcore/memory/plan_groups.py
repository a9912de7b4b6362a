"""How the planner groups a model's layers into KV cache groups.

Layers with one spec share a block table, so they form groups. A model whose
layers all share one spec is one group. A model whose layers share one spec
*type* (same class, block size and window) but differ in shape is one group
with a ``UniformTypeKVCacheSpecs``. Any other (hybrid) model first gets one
page size for every layer, the largest:

- a smaller page that divides it gets a proportionally larger block size;
- otherwise state caches and non-MLA attention pad their page
  (``page_size_padded``); MLA cannot be padded and is refused.

The common page is rounded up to a multiple of every layer's element size
(``dtype_alignment``), and a state cache whose states mix element sizes is
padded to a multiple of its largest one, so no block starts mid-element.

Then each spec's layers, in model order, are cut into groups of the smallest
spec's layer count (Gemma-3 with 10 full and 52 sliding layers: one full
group of 10, sliding groups of 10, 10, 10, 10, 10 and 2). Encoder-only layers
keep no cache; they get groups of their own, placed after all cache groups
so that cache group ids do not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from kvcore.memory.config import KVCacheGroupSpec
from kvcore.specs import (
    KVCacheSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)


def _type_key(spec: KVCacheSpec) -> tuple:
    """What layers must share to sit in one group despite different shapes."""
    return (
        type(spec),
        spec.block_size,
        getattr(spec, "sliding_window", None),
        getattr(spec, "attention_chunk_size", None),
    )


def unify_page_size(spec: KVCacheSpec, page: int, layer_name: str) -> KVCacheSpec:
    """``spec`` changed so that its page is ``page`` bytes (at least its own page)."""
    current = spec.page_size_bytes
    if current == page:
        return spec
    if page % current == 0 and spec.page_size_padded is None:
        scaled = spec.copy_with_new_block_size(spec.block_size * (page // current))
        # NOTE: state caches keep one state per block, so a larger block does
        # not grow their page; they fall through to padding.
        if scaled.page_size_bytes == page:
            return scaled
    if isinstance(spec, MLAAttentionSpec):
        raise ValueError(
            f"MLA layer {layer_name!r} has a {current}-byte page (block size "
            f"{spec.block_size}) that does not divide the model's common page of "
            f"{page} bytes (the largest page, rounded up to a multiple of every "
            "element size), and MLA pages cannot be padded; choose block sizes whose "
            "pages divide the largest page"
        )
    if not _paddable(spec):
        raise ValueError(
            f"layer {layer_name!r} ({type(spec).__name__}) has a {current}-byte page "
            f"that neither divides the model's largest page of {page} bytes nor can "
            "be padded; choose block sizes whose pages divide the largest page"
        )
    return attrs.evolve(spec, page_size_padded=page)


def _paddable(spec: KVCacheSpec) -> bool:
    return attrs.has(type(spec)) and "page_size_padded" in attrs.fields_dict(type(spec))


def align_page(spec: KVCacheSpec) -> KVCacheSpec:
    """``spec`` padded so that its page is a multiple of its largest element size.

    Only state caches whose states mix element sizes (a 6-byte page of one
    float16 and one float32) need it: their next block would otherwise start
    mid-element. Specs that cannot be padded are returned unchanged.
    """
    page, align = spec.page_size_bytes, spec.dtype_alignment
    if page % align == 0 or not _paddable(spec):
        return spec
    return attrs.evolve(spec, page_size_padded=-(-page // align) * align)


def _cache_groups(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    specs = {name: align_page(spec) for name, spec in specs.items()}
    distinct = dict.fromkeys(specs.values())
    if len(distinct) == 1:
        return [KVCacheGroupSpec(list(specs), next(iter(distinct)))]
    if len({_type_key(s) for s in distinct}) == 1:
        block_size = next(iter(distinct)).block_size
        return [KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size, specs))]

    # NOTE: the common page is a multiple of every element size, so that a
    # padded page never makes the next block start mid-element.
    align = math.lcm(*(s.dtype_alignment for s in distinct))
    page = -(-max(s.page_size_bytes for s in distinct) // align) * align
    first_layer = {}
    for name, spec in specs.items():
        first_layer.setdefault(spec, name)
    unified = {s: unify_page_size(s, page, first_layer[s]) for s in distinct}
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
    """KV cache groups of a model, ``kv_cache_specs`` being in model order.

    Cache groups come first (in the order their spec first appears), then one
    group per distinct encoder-only spec. Layer names keep the model's order
    inside every group.
    """
    cached: dict[str, KVCacheSpec] = {}
    encoder: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        if not spec.has_cache_pages:
            encoder.setdefault(spec, []).append(name)
        else:
            cached[name] = spec
    groups = _cache_groups(cached) if cached else []
    groups.extend(KVCacheGroupSpec(names, spec) for spec, names in encoder.items())
    return groups


def is_encoder_only(group: KVCacheGroupSpec) -> bool:
    """Whether a group's layers keep no KV cache."""
    return not group.kv_cache_spec.has_cache_pages
