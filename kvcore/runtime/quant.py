"""A quantized cache at run time: scale views over the one allocation, per-tensor scales from the
model, and the per-layer :class:`KVQuantState` a backend's metadata carries."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.memory.views import allocate_scale_views
from kvcore.plugins.backend import KVQuantState
from kvcore.specs.quant import PER_TENSOR

ScalePair = tuple[float, float]


def scale_caches_of(
    config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor], kernel_sizes: list | None
) -> dict[str, torch.Tensor]:
    """Every per-token-head layer's float32 scale view, over the allocation of ``kv_caches``."""
    if not kv_caches:
        return {}
    view = next(iter(kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())
    return allocate_scale_views(config, raw, kernel_sizes)


def _layers(config: KVCacheConfig, kv_quant: str | None = None) -> Iterable[tuple[str, Any]]:
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            spec = group.spec_of(name)
            mode = getattr(spec, "kv_quant", None)
            if mode is not None and kv_quant in (None, mode):
                yield name, spec


def _scale(layer: str, what: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{layer}.{what} must be a float or a 0-d tensor, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{layer}.{what}={value} must be a positive finite scale (1.0 for none)")
    return float(value)


def per_tensor_scales(
    config: KVCacheConfig, modules: Mapping[str, Any] | None = None
) -> dict[str, ScalePair]:
    """``(k, v)`` of every per-tensor layer: its module's ``k_scale`` / ``v_scale`` (absent: 1.0)."""
    if modules is not None and not isinstance(modules, Mapping):
        raise TypeError(f"modules must map layer names to attention modules, got {modules!r}")
    out = {}
    for name, _ in _layers(config, PER_TENSOR):
        module = (modules or {}).get(name)
        k, v = (getattr(module, attr, 1.0) for attr in ("k_scale", "v_scale"))
        out[name] = (_scale(name, "k_scale", k), _scale(name, "v_scale", v))
    return out


def quant_states(
    config: KVCacheConfig, scale_caches: Mapping[str, torch.Tensor], kv_scales: Mapping[str, ScalePair]
) -> dict[str, KVQuantState]:
    """The :class:`KVQuantState` of every quantized layer (made once, handed every step)."""
    return {
        name: KVQuantState(spec.kv_quant, spec.dtype, *kv_scales.get(name, (1.0, 1.0)),
                           scale_caches.get(name))  # fmt: skip
        for name, spec in _layers(config)
    }


@functools.cache
def _takes_kv_quant(cls: type) -> bool:
    return attrs.has(cls) and "kv_quant" in attrs.fields_dict(cls)


def layer_metadata(
    metadata: Any, layer_names: Iterable[str], states: Mapping[str, KVQuantState]
) -> dict[str, Any]:
    """Each layer's metadata: ``metadata`` itself, or a copy carrying the layer's quant state."""
    out = {}
    for name in layer_names:
        state = states.get(name)
        if state is not None and not _takes_kv_quant(type(metadata)):
            raise TypeError(
                f"layer {name!r} has a quantized cache but its backend's metadata "
                f"({type(metadata).__name__}) has no kv_quant field; declare one (attrs) to serve it"
            )
        out[name] = metadata if state is None else attrs.evolve(metadata, kv_quant=state)
    return out
