"""Quantized KV caches: the ``kv_cache_dtype`` modes, the storage each one means, and attention
specs turned into quantized specs (docs/quantized-cache.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvcore.specs.base import KVCacheSpec

PER_TENSOR, PER_TOKEN_HEAD = "per_tensor", "per_token_head"
#: Storage dtypes each ``kv_quant`` takes.
KV_QUANT_DTYPES = {
    PER_TENSOR: (torch.float8_e4m3fn, torch.float8_e5m2),
    PER_TOKEN_HEAD: (torch.float8_e4m3fn, torch.int8),
}
#: ``kv_cache_dtype`` -> (storage dtype, ``kv_quant``); "auto" keeps the model's dtype.
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, str] | None] = {
    "auto": None,
    "fp8": (torch.float8_e4m3fn, PER_TENSOR),
    "fp8_e4m3": (torch.float8_e4m3fn, PER_TENSOR),
    "fp8_e5m2": (torch.float8_e5m2, PER_TENSOR),
    "int8_per_token_head": (torch.int8, PER_TOKEN_HEAD),
    "fp8_per_token_head": (torch.float8_e4m3fn, PER_TOKEN_HEAD),
}
SCALE_BYTES = 8  # NOTE: a per-token-head page's scales per (head, state): float32 K, V


def parse_kv_cache_dtype(value: Any) -> str:
    """``value`` as a mode name (``"fp8"`` is ``"fp8_e4m3"``), else an error listing the modes."""
    if not isinstance(value, str):
        raise TypeError(f"kv_cache_dtype must be a str such as 'fp8', got {value!r}")
    mode = value.strip().lower()
    if mode not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={value!r} is not a KV cache mode; valid: {', '.join(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if mode == "fp8" else mode


def check_kv_quant(spec: Any) -> None:
    """Refuse an attention spec whose ``kv_quant`` and storage ``dtype`` do not go together."""
    mode, name = spec.kv_quant, type(spec).__name__
    if mode is not None and (not isinstance(mode, str) or mode not in KV_QUANT_DTYPES):
        raise ValueError(f"{name}.kv_quant={mode!r} is not a quantization kvcore stores; use None, "
                         f"{PER_TENSOR!r} or {PER_TOKEN_HEAD!r} (or pass kv_cache_dtype= where the cache is made)")
    if mode is not None and spec.dtype not in KV_QUANT_DTYPES[mode]:
        names = " or ".join(map(str, KV_QUANT_DTYPES[mode]))
        raise ValueError(f"{name}.kv_quant={mode!r} stores {names}, not {spec.dtype}; pass dtype={names}")
    if mode == PER_TOKEN_HEAD and (spec.tokens_per_state != 1 or spec.state_content_size_bytes % 4):
        raise ValueError(f"{name}: per-token-head scales need one state per token and rows of a multiple of 4 "
                         f"bytes, got tokens_per_state={spec.tokens_per_state} and {spec.state_content_size_bytes}"
                         f"-byte rows; use kv_quant={PER_TENSOR!r} or None")


def quantize_specs(specs: Mapping[str, Any], kv_cache_dtype: Any) -> dict[str, Any]:
    """``specs`` with every attention layer that keeps pages stored as ``kv_cache_dtype`` says
    ("auto": unchanged); state caches are never quantized."""
    storage = KV_CACHE_DTYPES[parse_kv_cache_dtype(kv_cache_dtype)]
    if storage is None or not isinstance(specs, Mapping):  # NOTE: the caller refuses a non-mapping
        return specs
    dtype, kv_quant = storage
    out = dict(specs)
    for name, spec in specs.items():
        if isinstance(spec, KVCacheSpec) and spec.is_attention and spec.has_cache_pages:
            if spec.state_content_bytes is not None:
                raise ValueError(f"layer {name!r} sets state_content_bytes={spec.state_content_bytes}, which "
                                 f"kv_cache_dtype={kv_cache_dtype!r} cannot re-size; describe it by head sizes")
            out[name] = attrs.evolve(spec, dtype=dtype, kv_quant=kv_quant)
    return out


def kv_cache_dtype_of(specs: Any) -> str:
    """The mode of the attention specs among ``specs`` ("auto" unquantized, modes joined by ",")."""
    names = {next(n for n, s in list(KV_CACHE_DTYPES.items())[2:] if s == (spec.dtype, spec.kv_quant))
             for spec in specs if getattr(spec, "kv_quant", None) is not None}  # NOTE: [2:]: not auto, fp8
    return ",".join(sorted(names)) or "auto"
