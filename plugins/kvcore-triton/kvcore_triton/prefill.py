"""Varlen paged attention for prefill, chunked prefill and mixed batches.

One program serves ``BLOCK_Q`` new tokens of one request and one KV head,
with all query heads of the GQA group stacked as rows (row ``r`` is token
``r // GROUP_PAD``, head ``r % GROUP_PAD`` of the group). New tokens are the
last ``q_len`` of the request's ``seq_len`` tokens; keys are streamed through
the block table ``TILE`` at a time with a causal (and optional sliding-window)
mask and an online softmax in float32. A quantized cache is read as in the
decode kernel: 8-bit tiles widened in registers, per-token-head K scales on the
score columns, V scales on the probabilities.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore_triton.decode import _scaled_probs, _scaled_scores


# NOTE: index tensors sit at step-dependent offsets of one packed buffer, a block table is as wide
# as the step needs and a window differs per group: not specializing on them keeps one compiled
# variant whatever the step (the engine warms it when built).
@triton.jit(do_not_specialize=["window", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _varlen_kernel(
    q_ptr, kv_ptr, scale_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, v_scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kn, stride_kc,
    stride_bt, stride_ot, stride_oh, stride_sb, stride_sh, stride_sn,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len + q_block * BLOCK_Q

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    r_ok = (tok < q_len) & (g < GROUP)
    q_pos = seq_len - q_len + tok
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q_off = (q_begin + tok).to(tl.int64) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=r_ok[:, None] & (d[None, :] < HEAD), other=0.0).to(DOT_DTYPE)

    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    hi = last_pos + 1
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DV_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    scale_head = scale_ptr + kv_head.to(tl.int64) * stride_sh
    for start in range(lo, hi, TILE):
        k_pos = start + tl.arange(0, TILE)
        k_ok = k_pos < hi
        block = tl.load(table_row + k_pos // BLOCK_N, mask=k_ok, other=0).to(tl.int64)
        row = block * stride_kb + (k_pos % BLOCK_N) * stride_kn
        scales = scale_head + block * stride_sb + (k_pos % BLOCK_N) * stride_sn
        k = tl.load(
            head_base + row[:, None] + d[None, :] * stride_kc,
            mask=k_ok[:, None] & (d[None, :] < HEAD), other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        s = _scaled_scores(s, scales, k_ok, True, QUANT)
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        visible = visible & ((window <= 0) | (q_pos[:, None] - k_pos[None, :] < window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a row may see no key yet (window not reached): keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            head_base + row[:, None] + (HEAD + dv[None, :]) * stride_kc,
            mask=k_ok[:, None] & (dv[None, :] < HEAD_V), other=0.0,
        )
        p = _scaled_probs(p, scales, k_ok, v_scale, True, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_begin + tok).to(tl.int64) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(
        out_ptr + o_off[:, None] + dv[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & (dv[None, :] < HEAD_V),
    )
