"""The gated RMS norm that closes transformers' Mamba2 mixers (Bamba, GraniteMoeHybrid, NemotronH)
in one launch. The module's own code takes about ten passes (casts, the gate's SiLU, square, mean,
reciprocal root, two products), each a kernel launch: at a decode batch or a prefill chunk they
cost more in launches than in arithmetic.

The sums run in float32 as the module's do; the normalized values are rounded to the input's
dtype before the weight multiplies them, as the module does. Float32 models keep the module's own
code: their tokens equal transformers' to the last bit of the sums' order."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvcore_triton.scan_kernels import runs_on

#: transformers' gated norms computed here: ``weight * rms_norm(y * silu(gate)).to(y.dtype)`` over
#: groups of ``group_size`` channels (over all channels in versions whose norm has no groups).
GATED_NORMS = frozenset({"BambaRMSNormGated", "GraniteMoeHybridRMSNormGated", "NemotronHRMSNormGated",
                         "MambaRMSNormGated", "Zamba2RMSNormGated"})


@triton.jit(do_not_specialize=["sy", "sz", "so"])
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, group, eps, sy, sz, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * group + tl.arange(0, BLOCK)
    ok = tl.arange(0, BLOCK) < group
    y = tl.load(y_ptr + row * sy + cols, mask=ok, other=0.0)
    z = tl.load(z_ptr + row * sz + cols, mask=ok, other=0.0).to(tl.float32)
    h = y.to(tl.float32) * (z * tl.sigmoid(z))
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / group + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * so + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def fused_gated_norm(norm: Any, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """``norm(y, gate)`` in one launch for the gated norms in :data:`GATED_NORMS` of a 16-bit model,
    or None where the kernel does not apply (another module, a float32 model, whose tokens keep to
    the module's own sums, a device Triton does not run on, shapes it does not take)."""
    kind = type(norm)
    if kind.__name__ not in GATED_NORMS or not kind.__module__.startswith("transformers.") or "forward" in vars(norm):
        return None
    dim = y.shape[-1]
    weight, group = getattr(norm, "weight", None), getattr(norm, "group_size", dim)
    if (not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float16, torch.bfloat16)
            or not isinstance(group, int) or group <= 0 or dim % group
            or tuple(weight.shape) != (dim,) or gate.shape != y.shape or not runs_on(y.device)
            or y.dtype not in (torch.float16, torch.bfloat16, torch.float32) or gate.dtype not in
            (torch.float16, torch.bfloat16, torch.float32)):
        return None
    rows_y, rows_z = y.reshape(-1, dim), gate.reshape(-1, dim)
    if rows_y.stride(-1) != 1:
        rows_y = rows_y.contiguous()
    if rows_z.stride(-1) != 1:
        rows_z = rows_z.contiguous()
    out = torch.empty(rows_y.shape, dtype=torch.promote_types(weight.dtype, y.dtype), device=y.device)
    if out.numel():
        _gated_rms_norm_kernel[(rows_y.shape[0], dim // group)](
            rows_y, rows_z, weight, out, group, float(norm.variance_epsilon), rows_y.stride(0), rows_z.stride(0),
            out.stride(0), BLOCK=triton.next_power_of_2(group))
    return out.view(y.shape)


def gated_norm(norm: Any, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``norm(y, gate)``: in one launch where :func:`fused_gated_norm` applies, else the module's own code."""
    out = fused_gated_norm(norm, y, gate)
    return norm(y, gate) if out is None else out
