"""A quantized cache at run time: scale views over the one allocation, per-tensor scales from the
model, and the per-layer :class:`KVQuantState` a backend's metadata carries."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.plugins.backend import KVQuantState


def _scale(layer: str, what: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = float(value.detach().reshape(()).cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{layer}.{what} must be a float or a 0-d tensor, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{layer}.{what}={value} must be a positive finite scale (1.0 for none)")
    return float(value)


def per_tensor_scales(config: KVCacheConfig, modules: Mapping[str, Any] | None = None) -> dict:
    """``(k, v)`` of every per-tensor layer: its module's ``k_scale`` / ``v_scale`` (absent: 1.0)."""
    if not isinstance(modules := modules or {}, Mapping):
        raise TypeError(f"modules must map layer names to attention modules, got {modules!r}")
    return {name: tuple(_scale(name, a, getattr(modules.get(name), a, 1.0)) for a in ("k_scale", "v_scale"))
            for name, spec in config.layer_specs.items() if getattr(spec, "kv_quant", None) == "per_tensor"}


def quant_states(config: KVCacheConfig, scale_caches: Mapping, kv_scales: Mapping) -> dict[str, KVQuantState]:
    """The :class:`KVQuantState` of every quantized layer (made once, handed every step)."""
    return {
        name: KVQuantState(spec.kv_quant, spec.dtype, *kv_scales.get(name, (1.0, 1.0)), scale_caches.get(name))
        for name, spec in config.layer_specs.items()
        if getattr(spec, "kv_quant", None) is not None
    }


def layer_metadata(metadata: Any, layer_names: Iterable[str], states: Mapping[str, KVQuantState]) -> dict:
    """Each layer's metadata: ``metadata`` itself, or a copy carrying the layer's quant state."""
    out = {}
    for name in layer_names:
        state = states.get(name)
        if state is not None and not hasattr(getattr(type(metadata), "__attrs_attrs__", None), "kv_quant"):
            raise TypeError(f"layer {name!r} has a quantized cache but its backend's metadata "
                            f"({type(metadata).__name__}) has no kv_quant field; declare one (attrs) to serve it")
        out[name] = metadata if state is None else attrs.evolve(metadata, kv_quant=state)
    return out
