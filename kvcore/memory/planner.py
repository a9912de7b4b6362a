"""Plan a model's KV cache: groups, bytes per block, block count and tensors."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvcore._validate import non_negative_int, positive_int
from kvcore.memory.config import KVCacheConfig, is_state_spec
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.pages import (  # noqa: F401  (group_layers, is_encoder_only, REGION_ALIGNMENT: this module's too)
    MIN_BLOCKS,
    REGION_ALIGNMENT,
    PagePlan,
    _cache_groups,
    check_hashable,
    group_layers,
    is_encoder_only,
    lay_groups,
)
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs


def _check_specs(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    if not isinstance(kv_cache_specs, Mapping):
        raise TypeError("kv_cache_specs must map layer names to specs in model order, got "
                        f"{type(kv_cache_specs).__name__}")
    if not kv_cache_specs:
        raise ValueError("kv_cache_specs is empty; describe at least one layer")
    for name, spec in kv_cache_specs.items():  # NOTE: KVCacheGroupSpec checks the names
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise TypeError(f"layer {name!r} needs a per-layer KVCacheSpec (e.g. FullAttentionSpec), " f"got {spec!r}")
        check_hashable(f"the spec of layer {name!r}", spec)
    return dict(kv_cache_specs)


def checked_budget(available_memory: int | None, num_blocks: int | None) -> tuple[int | None, int | None]:
    """Exactly one of ``available_memory`` (bytes) and ``num_blocks`` (at least 2), checked."""
    if (available_memory is None) == (num_blocks is None):
        raise ValueError("pass exactly one of available_memory (bytes) or num_blocks, got "
                         f"available_memory={available_memory!r}, num_blocks={num_blocks!r}")
    if num_blocks is None:
        return non_negative_int("available_memory", available_memory), None
    num_blocks = positive_int("num_blocks", num_blocks)
    if num_blocks < MIN_BLOCKS:
        raise ValueError(f"num_blocks={num_blocks} leaves no usable block (block 0 is the null block); "
                         "plan at least 2 blocks")
    return None, num_blocks


def lay_out(
    kv_cache_specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout | str, num_state_blocks: int | None = None,
) -> PagePlan:
    """Group ``kv_cache_specs`` (model order) and lay their pages out in ``layout``; with
    ``num_state_blocks``, the state caches in a region of their own, first."""
    specs, layout = _check_specs(kv_cache_specs), KVCacheLayout.parse(layout)
    if num_state_blocks is None:
        return lay_groups(group_layers(specs), layout)
    states = {n: s for n, s in specs.items() if is_state_spec(s)}
    others = group_layers({n: s for n, s in specs.items() if n not in states})
    cached = [g for g in others if not is_encoder_only(g)]
    if not states or not cached:
        raise ValueError("separate state pages need state caches and at least one layer beside them; plan this "
                         "model with separate_state_pages=False")
    state_groups = _cache_groups(states)
    region, pages = lay_groups(state_groups, layout), lay_groups(others, layout)
    groups = cached + state_groups + [g for g in others if is_encoder_only(g)]
    return attrs.evolve(pages, groups=groups, refusal=pages.refusal or region.refusal, states=region,
                        num_state_blocks=num_state_blocks)


def state_region_blocks(specs: Mapping[str, KVCacheSpec], separate: object, num_state_blocks: object,
                        max_num_seqs: int, prefix_caching: bool = False) -> int | None:
    """The blocks of a separate state region (None: no region): ``num_state_blocks``, by default a
    slot per sequence and state group (as many again for prefix caching's checkpoints) and the
    null block."""
    if not isinstance(separate, bool):
        raise TypeError(f"separate_state_pages must be True or False, got {separate!r}")
    if num_state_blocks is not None and not separate:
        raise ValueError(f"num_state_blocks={num_state_blocks!r} sizes the separate state region; pass "
                         "separate_state_pages=True with it, or drop it")
    states = {n: s for n, s in specs.items() if is_state_spec(s)}
    if not separate or not states:
        return None
    if num_state_blocks is None:
        num_state_blocks = (2 if prefix_caching else 1) * max_num_seqs * len(group_layers(states)) + 1
    if positive_int("num_state_blocks", num_state_blocks) < MIN_BLOCKS:
        raise ValueError(f"num_state_blocks={num_state_blocks} leaves no state slot (block 0 is the null block); "
                         "plan at least 2")
    return num_state_blocks


def plan_kv_cache(
    kv_cache_specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout | str, *, available_memory: int | None = None,
    num_blocks: int | None = None, separate_state_pages: bool = False, num_state_blocks: int | None = None,
) -> KVCacheConfig:
    """Plan the KV cache of a model whose layers are ``kv_cache_specs`` (in model order), with
    exactly one of ``available_memory`` (bytes) or ``num_blocks``; an encoder-only model gets no
    tensors and ``num_blocks`` blocks (2 for any budget).

    ``separate_state_pages=True``: state caches get a region of their own at the start of the
    allocation, ``num_state_blocks`` blocks of their natural page (the null block included); the
    other layers keep their own pages, and the budget sizes their pool after that region.
    """
    layout = KVCacheLayout.parse(layout)
    specs = _check_specs(kv_cache_specs)
    available_memory, num_blocks = checked_budget(available_memory, num_blocks)
    if separate_state_pages is True and num_state_blocks is None:
        raise ValueError("separate_state_pages=True needs num_state_blocks: a slot per sequence and state group, "
                         "and the null block (KVCache.create defaults it to max_num_seqs + 1)")
    region = state_region_blocks(specs, separate_state_pages, num_state_blocks, 1)
    if separate_state_pages and region is None:
        raise ValueError("separate_state_pages=True needs state caches; this model has none")
    pages = lay_out(kv_cache_specs, layout, region)
    if pages.refusal is not None:  # NOTE: checked before the budget: the layout error is more useful
        raise pages.error()
    num_blocks = pages.blocks_for(available_memory) if num_blocks is None else num_blocks
    if isinstance(num_blocks, str):
        raise ValueError(num_blocks)
    return pages.place(num_blocks)
