"""Quantized caches in the Triton kernels: the in-register conversion to the storage dtype (the
write kernel) and the launch arguments a layer's ``KVQuantState`` gives every kernel.

Stored values and scales are those of the torch reference (``kvcore_torch.quant``), byte for
byte: per tensor ``x * (1 / scale)`` saturated; per token and head ``x * (max / amax)`` saturated
(the inverse at most float32's largest finite value), scale ``amax / max`` (0 for a zero row),
both divisions rounded to nearest; integers round half away from zero, floats to nearest even.
Kernels read 8-bit tiles, widen them in registers, and scale the scores (K) and the
probabilities (V) instead of the tiles.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvcore.plugins.backend import KVQuantState
from kvcore_triton._checks import INTERPRETER_ON

#: ``QUANT`` constexpr values of the kernels.
NONE, PER_TENSOR, PER_TOKEN_HEAD = 0, 1, 2
_MODES = {None: NONE, "per_tensor": PER_TENSOR, "per_token_head": PER_TOKEN_HEAD}
#: (mantissa bits, smallest normal exponent) of the float8 storage dtypes.
_FLOAT8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@attrs.frozen
class QuantArgs:
    """A launch's quantization arguments (dummies for an unquantized cache)."""

    mode: int
    scales: torch.Tensor  # NOTE: the scale view, or the data view standing in for it
    strides: tuple[int, int, int]
    k_scale: float
    v_scale: float
    qmax: float
    integer: bool
    mantissa: int
    min_exponent: int


def quant_args(kv_cache_view: torch.Tensor, kv_quant: KVQuantState | None) -> QuantArgs:
    """The arguments every kernel takes for ``kv_cache_view`` (checked by the caller)."""
    if kv_quant is None:
        return QuantArgs(NONE, kv_cache_view, (0, 0, 0), 1.0, 1.0, 1.0, False, 0, 0)
    dtype = kv_quant.dtype
    floating = dtype.is_floating_point
    qmax = float(torch.finfo(dtype).max if floating else torch.iinfo(dtype).max)
    mantissa, min_exponent = _FLOAT8.get(dtype, (0, 0))
    mode = _MODES[kv_quant.kv_quant]
    if mode == PER_TENSOR:
        scales, strides, k_scale, v_scale = kv_cache_view, (0, 0, 0), kv_quant.k_scale, kv_quant.v_scale
    else:  # NOTE: per token and head, the scales live in the page; V's are taken times max (decode.py)
        scales, strides, k_scale, v_scale = kv_quant.scale_cache, kv_quant.scale_cache.stride()[:3], 1.0, 1 / qmax
    return QuantArgs(mode, scales, strides, k_scale, v_scale, qmax, not floating, mantissa, min_exponent)


@triton.jit
def round_to_float8(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``x`` (float32) rounded to nearest even on the float8 grid, subnormals included, so the
    cast that follows is exact (the interpreter's own float8 cast drops the carry of a round-up)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, MIN_EXPONENT + 127)
    quantum = ((exponent - MANTISSA) << 23).to(tl.float32, bitcast=True)
    # NOTE: adding and subtracting 1.5 * 2**23 rounds a float32 below 2**22 to an integer, ties to even.
    rounded = ((x / quantum + 12582912.0) - 12582912.0) * quantum
    return tl.where(rounded == 0, x * 0.0, rounded)  # NOTE: keeps the sign of a value rounding to zero


@triton.jit
def to_storage(x, QMAX: tl.constexpr, INTEGER: tl.constexpr, EXACT_CAST: tl.constexpr,
               MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Scaled float32 ``x`` saturated to ``[-QMAX, QMAX]`` and rounded for the storage cast."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    if INTEGER:
        x = tl.where(x >= 0, tl.floor(x + 0.5), tl.ceil(x - 0.5))
    elif EXACT_CAST:
        x = round_to_float8(x, MANTISSA, MIN_EXPONENT)
    return x


@triton.jit
def quantize_rows(x, scale_ptrs, inv_scale, row_ok, QUANT: tl.constexpr, QMAX: tl.constexpr,
                  INTEGER: tl.constexpr, EXACT_CAST: tl.constexpr, MANTISSA: tl.constexpr,
                  MIN_EXPONENT: tl.constexpr):
    """Rows ``x`` ``[heads, D]`` (zero-padded) as stored; per token and head, each row's scale is
    written to ``scale_ptrs`` ``[heads]`` where ``row_ok``."""
    x = x.to(tl.float32)
    if QUANT == 2:
        # NOTE: divisions rounded to nearest (a plain `/` is approximate on GPUs), the inverse kept
        # finite for rows below about 1e-36: the reference's bytes on every device.
        amax = tl.max(tl.abs(x), 1)
        tl.store(scale_ptrs, tl.math.div_rn(amax, QMAX), mask=row_ok)
        inverse = tl.minimum(tl.math.div_rn(QMAX, tl.where(amax > 0, amax, 1.0)), 3.4028234663852886e38)
        x = x * tl.where(amax > 0, inverse, 0.0)[:, None]
    else:
        x = x * inv_scale
    return to_storage(x, QMAX, INTEGER, EXACT_CAST, MANTISSA, MIN_EXPONENT)


#: ``WIDEN`` constexpr values: how ``widen`` turns an 8-bit tile into float16 with inline PTX.
WIDEN_CAST, WIDEN_E4M3, WIDEN_E5M2, WIDEN_INT8 = 0, 1, 2, 3
_WIDEN = {torch.float8_e4m3fn: WIDEN_E4M3, torch.float8_e5m2: WIDEN_E5M2, torch.int8: WIDEN_INT8}
#: Four packed 8-bit values in ``$2`` to two float16 pairs ``$0``, ``$1`` (first value in the low bytes).
_PTX_FLOAT8 = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
               "cvt.rn.f16x2.FMTx2 $0, lo; cvt.rn.f16x2.FMTx2 $1, hi; }")
PTX_E4M3: tl.constexpr = tl.constexpr(_PTX_FLOAT8.replace("FMT", "e4m3"))
PTX_E5M2: tl.constexpr = tl.constexpr(_PTX_FLOAT8.replace("FMT", "e5m2"))
# NOTE: int8 b: (b ^ 0x80) = b + 128 as the low byte of the float16 0x64XX (1024 + that byte,
# exact), minus 1152 (0x6480): b, exactly, in two byte permutes and two packed subtractions.
PTX_INT8: tl.constexpr = tl.constexpr(
    "{ .reg .b32 t, bias; xor.b32 t, $2, 0x80808080; mov.b32 bias, 0x64806480; "
    "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
    "sub.rn.f16x2 $0, $0, bias; sub.rn.f16x2 $1, $1, bias; }")


def widen_mode(dtype: torch.dtype, dot_dtype) -> int:
    """The ``WIDEN`` constexpr of a launch: inline PTX for an 8-bit cache on a GPU when the dot
    takes float16; else a plain cast (the interpreter runs no PTX)."""
    return WIDEN_CAST if INTERPRETER_ON or dot_dtype != tl.float16 else _WIDEN.get(dtype, WIDEN_CAST)


@triton.jit
def widen(x, DOT_DTYPE: tl.constexpr, WIDEN: tl.constexpr, AS_LOADED: tl.constexpr):
    """An 8-bit tile ``x`` as ``DOT_DTYPE``: with ``WIDEN`` (1 e4m3, 2 e5m2, 3 int8; 0 a cast),
    float16 from packed conversions of inline PTX, four values per 32-bit register. ``AS_LOADED``
    converts in the layout the tile was loaded in (full-width loads): a V tile then reaches the dot
    through a 16-bit shared-memory transpose instead of being loaded byte by byte in the dot's
    operand layout; else the conversion moves into the operand layout (K: 8-byte loads)."""
    # NOTE: is_pure=False keeps the compiler from moving the conversion into the operand layout.
    if WIDEN == 1:
        y = tl.inline_asm_elementwise(PTX_E4M3, "=r,=r,r", [x], dtype=tl.float16, is_pure=not AS_LOADED, pack=4)
    elif WIDEN == 2:
        y = tl.inline_asm_elementwise(PTX_E5M2, "=r,=r,r", [x], dtype=tl.float16, is_pure=not AS_LOADED, pack=4)
    elif WIDEN == 3:
        y = tl.inline_asm_elementwise(PTX_INT8, "=r,=r,r", [x], dtype=tl.float16, is_pure=not AS_LOADED, pack=4)
    else:
        y = x.to(DOT_DTYPE)
    return y


def dot_scale_factor(args: QuantArgs) -> float:
    """What multiplies ``q . k`` (per tensor: the K scale; per token: the column scales do)."""
    return args.k_scale if args.mode == PER_TENSOR else 1.0

