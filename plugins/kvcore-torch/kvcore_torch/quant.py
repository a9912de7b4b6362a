"""The reference quantization of a kvcore cache: what a quantized K/V row stores and reads back.

Per tensor: a stored value is ``x / scale`` (the layer's ``k_scale`` or ``v_scale``),
saturated to the storage dtype's range. Per token and head: ``scale = amax(|x|) / max``
over the row's head dim, a stored value is ``x * (max / amax)`` saturated (a zero row stores
zeros with scale 0). Integers round half away from zero; floats round to nearest even (the
dtype conversion). Reading multiplies back by the scale.
"""

from __future__ import annotations

import torch

from kvcore.plugins.backend import KVQuantState


def max_value(dtype: torch.dtype) -> float:
    """The largest finite value ``dtype`` stores (448 for e4m3, 57,344 for e5m2, 127 for int8)."""
    return float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``x`` saturated into ``dtype`` (never inf or NaN for finite ``x``)."""
    limit = max_value(dtype)
    x = x.clamp(-limit, limit)
    if not dtype.is_floating_point:
        x = torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))
    return x.to(dtype)


def quantize(x: torch.Tensor, kv_quant: KVQuantState, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (``[..., D]``) as stored: ``(values, None)`` per tensor (``scale``: the layer's), or
    ``(values, scales [...])`` per token and head."""
    x = x.float()
    dtype = kv_quant.dtype
    if kv_quant.kv_quant == "per_tensor":
        return to_storage(x * (1.0 / scale), dtype), None
    limit = max_value(dtype)
    amax = x.abs().amax(-1)
    inverse = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    return to_storage(x * inverse[..., None], dtype), amax / limit


def dequantize(values: torch.Tensor, scales: torch.Tensor | float) -> torch.Tensor:
    """Stored ``values`` (``[..., D]``) times their scale (a float or ``[...]``), in float32."""
    if isinstance(scales, torch.Tensor):
        scales = scales[..., None]
    return values.float() * scales
