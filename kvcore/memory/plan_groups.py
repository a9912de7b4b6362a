"""How the planner groups a model's layers into KV cache groups.

Layers with one spec form one group; layers of one spec *type* (class, block size, window)
but different shapes form one ``UniformTypeKVCacheSpecs`` group. A hybrid model first gets
one page size, the largest (rounded up to every element size): a smaller page that divides
it gets a larger block size, else state caches and non-MLA attention are padded (MLA is
refused). Each spec's layers are then cut, in model order, into groups of the smallest
spec's layer count. Encoder-only layers (no cache) get groups of their own, last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from kvcore.memory.config import KVCacheGroupSpec
from kvcore.memory.layout import round_up
from kvcore.specs import KVCacheSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs


def _type_key(spec: KVCacheSpec) -> tuple:
    """What layers must share to sit in one group despite different shapes."""
    return (
        type(spec),
        spec.block_size,
        getattr(spec, "sliding_window", None),
        getattr(spec, "attention_chunk_size", None),
    )


def _paddable(spec: KVCacheSpec) -> bool:
    return attrs.has(type(spec)) and "page_size_padded" in attrs.fields_dict(type(spec))


def _unify_page_size(spec: KVCacheSpec, page: int, layer_name: str) -> KVCacheSpec:
    """``spec`` changed so that its page is ``page`` bytes (at least its own page)."""
    current = spec.page_size_bytes
    if current == page:
        return spec
    if page % current == 0 and spec.page_size_padded is None:
        scaled = spec.copy_with_new_block_size(spec.block_size * (page // current))
        # NOTE: a state cache's page does not grow with its block size; it is padded.
        if scaled.page_size_bytes == page:
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


def _align_page(spec: KVCacheSpec) -> KVCacheSpec:
    """``spec`` padded to a multiple of its largest element size (a state cache of mixed dtypes)."""
    page, align = spec.page_size_bytes, spec.dtype_alignment
    if page % align == 0 or not _paddable(spec):
        return spec
    return attrs.evolve(spec, page_size_padded=round_up(page, align))


def _cache_groups(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    specs = {name: _align_page(spec) for name, spec in specs.items()}
    distinct = dict.fromkeys(specs.values())
    if len(distinct) == 1:
        return [KVCacheGroupSpec(list(specs), next(iter(distinct)))]
    if len({_type_key(s) for s in distinct}) == 1:
        block_size = next(iter(distinct)).block_size
        return [KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(block_size, specs))]

    align = math.lcm(*(s.dtype_alignment for s in distinct))
    page = round_up(max(s.page_size_bytes for s in distinct), align)
    first_layer = {}
    for name, spec in specs.items():
        first_layer.setdefault(spec, name)
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
    """KV cache groups of a model (``kv_cache_specs`` in model order; groups keep that order)."""
    cached: dict[str, KVCacheSpec] = {}
    encoder: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        if spec.has_cache_pages:
            cached[name] = spec
        else:
            encoder.setdefault(spec, []).append(name)
    groups = _cache_groups(cached) if cached else []
    groups.extend(KVCacheGroupSpec(names, spec) for spec, names in encoder.items())
    return groups


def is_encoder_only(group: KVCacheGroupSpec) -> bool:
    """Whether a group's layers keep no KV cache."""
    return not group.kv_cache_spec.has_cache_pages
