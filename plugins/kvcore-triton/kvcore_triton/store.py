"""Write new keys and values into a paged cache view with one Triton launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore.plugins.backend import KVQuantState
from kvcore_triton._checks import INTERPRETER_ON, check_kv_write, value_checks
from kvcore_triton.quant import quant_args, quantize_rows


# NOTE: slots sit at a step-dependent offset of one packed buffer: one variant for every step.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(
    key_ptr, value_ptr, slot_ptr, kv_ptr, scale_ptr, num_slots, num_heads, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_cn, stride_cc, stride_sb, stride_sh, stride_sn,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, INTEGER: tl.constexpr, EXACT_CAST: tl.constexpr,
    MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
):
    # One program stores every head of one token: [HEADS_PAD, D] tiles, 16-byte stores; a
    # quantized cache converts them in registers first (and stores each row's scale).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # NOTE: padding (negative) and out-of-range slots are skipped, never stored out of bounds.
    if (slot < 0) | (slot >= num_slots):
        return
    block, n = slot // BLOCK_N, slot % BLOCK_N
    base = kv_ptr + block * stride_cb + n * stride_cn
    h = tl.arange(0, HEADS_PAD)[:, None]
    h_ok = h < num_heads
    d = tl.arange(0, D_PAD)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=h_ok & (d < HEAD), other=0.0)
    dv = tl.arange(0, DV_PAD)[None, :]
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + dv, mask=h_ok & (dv < HEAD_V), other=0.0)
    if QUANT != 0:
        scales = scale_ptr + block * stride_sb + n * stride_sn + tl.arange(0, HEADS_PAD) * stride_sh
        heads_ok = tl.arange(0, HEADS_PAD) < num_heads
        k = quantize_rows(k, scales, inv_k_scale, heads_ok, QUANT, QMAX, INTEGER, EXACT_CAST, MANTISSA,
                          MIN_EXPONENT)
        v = quantize_rows(v, scales + 1, inv_v_scale, heads_ok, QUANT, QMAX, INTEGER, EXACT_CAST, MANTISSA,
                          MIN_EXPONENT)
    tl.store(base + h * stride_ch + d * stride_cc, k.to(kv_ptr.dtype.element_ty), mask=h_ok & (d < HEAD))
    tl.store(base + h * stride_ch + (HEAD + dv) * stride_cc, v.to(kv_ptr.dtype.element_ty),
             mask=h_ok & (dv < HEAD_V))


def write_kv(
    kv_cache_view: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
    *,
    validate: bool | None = None,
    kv_quant: KVQuantState | None = None,
) -> None:
    """Store each new token's ``key``/``value`` at its slot of ``kv_cache_view``.

    :param kv_cache_view: kernel-block view ``[B, H, N, C]`` in any layout.
    :param key: ``[T, H, head_size]``; ``value``: ``[T, H, head_size_v]``;
        both in the cache's dtype (quantized: any float dtype).
    :param slot_mapping: ``[T]`` slots ``block_id * N + offset``; negative
        slots mark padding tokens and are skipped.
    :param validate: check on the host that every slot is below ``B * N``
        (``ValueError`` and nothing written; a device sync on GPUs). None: on
        for CPU tensors or under ``KVCORE_DEBUG_CHECKS=1``, off on GPUs (no
        sync, CUDA-graph safe), where out-of-range slots are skipped.
    :param kv_quant: the layer's quantization (``metadata.kv_quant``), applied in the same
        launch: rows are scaled, saturated and stored 8-bit, per-token-head scales beside them.
    """
    num_slots = check_kv_write(
        kv_cache_view, key, value, slot_mapping, head_size,
        check_slots=value_checks(validate, kv_cache_view.device), kv_quant=kv_quant,
    )
    num_tokens = slot_mapping.shape[0]
    _, num_heads, block_size, _ = kv_cache_view.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    quant = quant_args(kv_cache_view, kv_quant)
    _store_kv_kernel[(num_tokens,)](
        key, value, slot_mapping, kv_cache_view, quant.scales, num_slots, num_heads,
        1.0 / quant.k_scale, 1.0 / quant.v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache_view.stride(), *quant.strides,
        HEAD=head_size, HEAD_V=value.shape[-1],
        D_PAD=triton.next_power_of_2(head_size), DV_PAD=triton.next_power_of_2(value.shape[-1]),
        HEADS_PAD=triton.next_power_of_2(num_heads), BLOCK_N=block_size,
        QUANT=quant.mode, QMAX=quant.qmax, INTEGER=quant.integer, EXACT_CAST=INTERPRETER_ON,
        MANTISSA=quant.mantissa, MIN_EXPONENT=quant.min_exponent,
    )
