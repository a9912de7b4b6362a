"""Split-K paged decode attention (flash-decoding) for one new token per request.

One program serves one (request, KV head, context split): it loads the whole
GQA group's queries once, streams its share of the context through the block
table ``TILE`` tokens at a time (a tile may span several kernel blocks), and
keeps an online softmax in float32. A second small kernel merges the splits.
The cache is read through its four strides, so every layout works.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_ml_ptr, part_acc_ptr, out_ptr,
    qk_scale, window, tokens_per_split, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kn, stride_kc,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE: tl.constexpr, SINGLE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    q_row = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_row:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    lo = ctx_start + split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    g_ok = g < GROUP
    q_off = q_row.to(tl.int64) * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & (d[None, :] < HEAD), other=0.0).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DV_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
    for start in range(lo, hi, TILE):
        tok = start + tl.arange(0, TILE)
        t_ok = tok < hi
        block = tl.load(table_row + tok // BLOCK_N, mask=t_ok, other=0).to(tl.int64)
        row = block * stride_kb + (tok % BLOCK_N) * stride_kn
        k = tl.load(
            head_base + row[:, None] + d[None, :] * stride_kc,
            mask=t_ok[:, None] & (d[None, :] < HEAD), other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            head_base + row[:, None] + (HEAD + dv[None, :]) * stride_kc,
            mask=t_ok[:, None] & (dv[None, :] < HEAD_V), other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE:
        o_off = q_row.to(tl.int64) * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh + dv[None, :]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (dv[None, :] < HEAD_V))
    else:
        # Partials: [req, kv_head, split, GROUP_PAD] for (m, l) and (..., DV_PAD) for acc.
        slot = ((req * num_kv_heads + kv_head) * num_splits + split).to(tl.int64) * GROUP_PAD + g
        tl.store(part_ml_ptr + slot * 2, m_i)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i)
        tl.store(part_acc_ptr + slot[:, None] * DV_PAD + dv[None, :], acc)


@triton.jit
def _decode_merge_kernel(
    part_ml_ptr, part_acc_ptr, out_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_V: tl.constexpr, DV_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    q_head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == q_row:
        return
    num_kv_heads = tl.num_programs(1) // GROUP
    kv_head = q_head // GROUP
    sp = tl.arange(0, SPLITS_PAD)
    dv = tl.arange(0, DV_PAD)
    sp_ok = sp < num_splits
    slot = ((req * num_kv_heads + kv_head) * num_splits + sp).to(tl.int64) * GROUP_PAD + q_head % GROUP
    m = tl.load(part_ml_ptr + slot * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + slot * 2 + 1, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + slot[:, None] * DV_PAD + dv[None, :], mask=sp_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_off = q_row.to(tl.int64) * stride_ot + q_head * stride_oh + dv
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=dv < HEAD_V)
