"""Hand allocated caches to a model's layers (a *forward context* maps names to layer objects),
and let layers share another layer's cache."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheGroupSpec


def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
    """The layer index in a dotted name: ``"model.layers.3.self_attn"`` -> 3; with
    ``num_attn_module > 1``, ``"layers.3.attn.1"`` -> ``3 * num_attn_module + 1``."""
    if not isinstance(layer_name, str):
        raise TypeError(f"layer_name must be a str, got {layer_name!r}")
    num_attn_module = positive_int("num_attn_module", num_attn_module)
    numbers = [int(part) for part in layer_name.split(".") if part.isascii() and part.isdigit()]
    per_module = num_attn_module > 1 and "attn" in layer_name
    if per_module and len(numbers) == 2:
        return numbers[0] * num_attn_module + numbers[1]
    if len(numbers) != 1:
        expected = "one or two integers" if per_module else "one integer"
        raise ValueError(f"layer name {layer_name!r} holds {len(numbers)} integer parts "
                         f"{numbers}, expected {expected} (e.g. 'model.layers.3.self_attn')")
    return numbers[0]


def _model_order(names: Iterable[str], num_attn_module: int) -> list[str]:
    # NOTE: sorted() is stable: layers at one index (self- and cross-attention
    # of a decoder layer) keep their order in the input.
    index = {name: extract_layer_index(name, num_attn_module) for name in names}
    return sorted(index, key=index.__getitem__)


def bind_kv_cache_to_layers(
    kv_caches: Mapping[str, torch.Tensor],
    forward_context: Mapping[str, Any],
    num_attn_module: int = 1,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> None:
    """Give every layer named in ``kv_caches`` its cache, in model order, or none at all: through
    its ``bind_kv_cache(tensor)`` method when it has one, else its ``kv_cache`` attribute."""
    order = _model_order(kv_caches, num_attn_module)
    grouped = {n for g in kv_cache_groups or () for n in g.layer_names}
    ungrouped = [n for n in order if n not in grouped]
    if kv_cache_groups is not None and ungrouped:
        raise ValueError(f"layers {ungrouped} have caches but are in no KV cache group; add them to "
                         "a group (for KV sharing, see add_kv_sharing_layers_to_kv_cache_groups)")
    missing = [n for n in order if n not in forward_context]
    if missing:
        raise ValueError(f"layers {missing} have caches but are not in the forward context")
    for name in order:
        layer = forward_context[name]
        if not hasattr(layer, "bind_kv_cache") and not hasattr(layer, "kv_cache"):
            raise TypeError(f"layer {name!r} ({type(layer).__name__}) cannot take a cache: "
                            "give it a bind_kv_cache(tensor) method or a kv_cache attribute")
    for name in order:
        layer = forward_context[name]
        if hasattr(layer, "bind_kv_cache"):
            layer.bind_kv_cache(kv_caches[name])
        else:
            layer.kv_cache = kv_caches[name]


def bind_kv_cache(kv_caches: Mapping[str, torch.Tensor], forward_context: Mapping[str, Any],
                  runner_kv_caches: list[torch.Tensor], num_attn_module: int = 1,
                  kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
                  layer_kv_caches: Mapping[str, torch.Tensor] | None = None) -> None:
    """Fill the empty ``runner_kv_caches`` with ``kv_caches`` in model order and bind each layer
    to its ``layer_kv_caches`` entry when given (kernel-block views), else its ``kv_caches`` one."""
    if len(runner_kv_caches) != 0:
        raise ValueError(f"runner_kv_caches already holds {len(runner_kv_caches)} caches; bind into "
                         "an empty list (clear it, or call clear_layer_kv_caches before rebinding)")
    order = _model_order(kv_caches, num_attn_module)
    bound = kv_caches if layer_kv_caches is None else layer_kv_caches
    bind_kv_cache_to_layers(bound, forward_context, num_attn_module, kv_cache_groups)
    runner_kv_caches.extend(kv_caches[name] for name in order)


def clear_layer_kv_caches(layers: Iterable[Any] | Mapping[str, Any]) -> None:
    """Drop the caches bound to ``layers`` (objects, or a forward context) to free memory."""
    if isinstance(layers, Mapping):
        layers = layers.values()
    for layer in layers:
        if hasattr(layer, "kv_cache"):
            layer.kv_cache = torch.tensor([]) if isinstance(layer.kv_cache, torch.Tensor) else []


def _group_of_layer(
    shared_kv_cache_layers: Mapping[str, str], kv_cache_groups: Sequence[KVCacheGroupSpec]
) -> dict[str, KVCacheGroupSpec]:
    owner = {n: g for g in kv_cache_groups for n in g.layer_names}
    for layer, target in shared_kv_cache_layers.items():
        if target not in owner:
            raise ValueError(f"layer {layer!r} shares the cache of {target!r}, which is in "
                             "no KV cache group; a target must be a layer that owns a cache")
        if layer in owner:
            raise ValueError(f"layer {layer!r} is already in a KV cache group, so it cannot also share "
                             f"the cache of {target!r}; drop it from its group or from the sharing map")
    return owner


def add_kv_sharing_layers_to_kv_cache_groups(shared_kv_cache_layers: Mapping[str, str],
                                             kv_cache_groups: Sequence[KVCacheGroupSpec],
                                             runner_only_attn_layers: set[str] | None = None) -> None:
    """Add each layer of ``shared_kv_cache_layers`` (sharing layer -> target) to its target's
    group, and to ``runner_only_attn_layers`` when given; all checked before anything changes."""
    owner = _group_of_layer(shared_kv_cache_layers, kv_cache_groups)
    for layer, target in shared_kv_cache_layers.items():
        owner[target].layer_names.append(layer)
        if runner_only_attn_layers is not None:
            runner_only_attn_layers.add(layer)


def initialize_kv_cache_for_kv_sharing(shared_kv_cache_layers: Mapping[str, str],
                                       kv_cache_groups: Sequence[KVCacheGroupSpec],
                                       kv_caches: MutableMapping[str, torch.Tensor]) -> None:
    """Point each sharing layer at its target's cache and add it to the target's group."""
    owner = _group_of_layer(shared_kv_cache_layers, kv_cache_groups)
    absent = sorted({t for t in shared_kv_cache_layers.values() if t not in kv_caches})
    if absent:
        raise ValueError(f"targets {absent} have no allocated cache in kv_caches; allocate them")
    for layer, target in shared_kv_cache_layers.items():
        kv_caches[layer] = kv_caches[target]
        owner[target].layer_names.append(layer)
