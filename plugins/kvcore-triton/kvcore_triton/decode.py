"""Split-K paged decode attention (flash-decoding) for one new token per request.

One program serves one (request, KV head, context split): it loads the whole
GQA group's queries once, streams its share of the context through the block
table ``TILE`` tokens at a time (a tile may span several kernel blocks), and
keeps an online softmax in float32. A second small kernel merges the splits.
The cache is read through its four strides, so every layout works.

Two read paths. Where a tile lies inside one kernel block (``TILE <= BLOCK_N``)
and the device has TMA (sm_90+; the interpreter emulates it), K and V come in
by TMA copies of ``[TILE, HEAD]`` boxes of a host-built descriptor over the
cache view; only a split's edge tiles are masked, their V rows past the
context are zeroed (they may hold anything, even NaN), and the grid runs the
KV heads of a request side by side (a 1-D grid, KV head fastest). Everywhere
else the pointer path gathers rows by address (one block-table read per
token, every tile masked) on a (request, KV head, split) grid. V is loaded
after the softmax of its tile. Those are the choices that measured fastest on
the H200 (BENCHMARKS.md); the variants that never won were removed.

Tiles start at multiples of ``TILE`` (tokens before the split's first one are
masked), so a tile covers whole kernel blocks or lies inside one.

A quantized cache (``QUANT`` 1: per tensor, 2: per token and head) is read as
8-bit tiles, widened to the dot dtype in registers; a per-tensor K scale is
folded into ``qk_scale`` and the V scale into the output, per-token-head K
scales multiply the score columns after ``q . k`` and V scales the
probabilities before ``p . v``, so no dequantized tile is ever written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcore_triton.quant import widen

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptrs, row_ok, col_ok, MASK_COLS: tl.constexpr):
    """``tl.load`` of a ``[rows, cols]`` tile, rows masked, columns only when padded."""
    if MASK_COLS:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return x


@triton.jit
def _token_blocks(table_row, tok, table_hi, BLOCK_N: tl.constexpr):
    """Each token's kernel block and in-block position.

    Reads stop at the table's width (``table_hi`` tokens), not at the context:
    the ids do not wait for ``seq_lens``, and ids past the context are only
    used under the K/V loads' own mask.
    """
    block = tl.load(table_row + tok // BLOCK_N, mask=tok < table_hi, other=0).to(tl.int64)
    return block, tok % BLOCK_N


@triton.jit
def _column_scales(scales, t_ok, MASKED: tl.constexpr):
    """A tile's per-token K or V scales (masked columns read 0 when ``MASKED``)."""
    if MASKED:
        x = tl.load(scales, mask=t_ok, other=0.0)
    else:
        x = tl.load(scales)
    return x


@triton.jit
def _scaled_scores(s, scales, t_ok, MASKED: tl.constexpr, QUANT: tl.constexpr):
    """Scores times each column's K scale (per token and head; else ``s``)."""
    if QUANT == 2:
        s = s * _column_scales(scales, t_ok, MASKED)[None, :]
    return s


@triton.jit
def _scaled_probs(p, scales, t_ok, v_scale, MASKED: tl.constexpr, QUANT: tl.constexpr):
    """Probabilities times each column's V scale over ``v_scale`` (per token and head; else ``p``).

    ``v_scale`` is 1 / max of the storage type here, applied to the output once: the products
    stay in float16's normal range (a probability times an amax, not times amax / 448).
    """
    if QUANT == 2:
        p = p * (_column_scales(scales + 1, t_ok, MASKED) * (1.0 / v_scale))[None, :]
    return p


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over one tile's base-2 scores ``s``: (new max, rescale factor, p, new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, row, scales, t_ok, head_base, qk_scale, v_scale, stride_kc,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, WIDEN: tl.constexpr,
    STAGE_V: tl.constexpr,
):
    """One online-softmax step over the tile's (masked) rows ``row`` (per-token-head scales at
    ``scales``); returns (m, l, acc)."""
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    k = _load_rows(head_base + row[:, None] + d[None, :] * stride_kc, t_ok, d < HEAD, HEAD != D_PAD)
    s = tl.dot(q, tl.trans(widen(k, DOT_DTYPE, WIDEN, False)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(t_ok[None, :], _scaled_scores(s, scales, t_ok, True, QUANT), float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
    v = _load_rows(head_base + row[:, None] + (HEAD + dv[None, :]) * stride_kc, t_ok, dv < HEAD_V,
                   HEAD_V != DV_PAD)
    p = _scaled_probs(p, scales, t_ok, v_scale, True, QUANT)
    v = widen(v, DOT_DTYPE, WIDEN, STAGE_V)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_tile_tma(
    q, m_i, l_i, acc, kv_desc, table_row, kv_head, start, lo, hi, qk_scale, v_scale, scale_head, stride_sb, stride_sn,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr,
    WIDEN: tl.constexpr, STAGE_V: tl.constexpr,
):
    """``_decode_tile`` for a tile inside one kernel block, read by two TMA copies (K, V)."""
    block = tl.load(table_row + start // BLOCK_N)
    n0 = start % BLOCK_N
    k = tl.reshape(kv_desc.load([block, kv_head, n0, 0]), [TILE, HEAD])
    s = tl.dot(q, tl.trans(widen(k, DOT_DTYPE, WIDEN, False)), input_precision=DOT_PRECISION) * qk_scale
    tok = start + tl.arange(0, TILE)
    t_ok = (tok >= lo) & (tok < hi)
    # NOTE: the tile lies inside one written or zeroed block: its scales need no mask.
    scales = scale_head + block.to(tl.int64) * stride_sb + (n0 + tl.arange(0, TILE)) * stride_sn
    s = _scaled_scores(s, scales, t_ok, MASKED, QUANT)
    if MASKED:
        s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(s, m_i, l_i)
    p = _scaled_probs(p, scales, t_ok, v_scale, MASKED, QUANT)
    v = tl.reshape(kv_desc.load([block, kv_head, n0, HEAD]), [TILE, HEAD_V])
    v = widen(v, DOT_DTYPE, WIDEN, STAGE_V)
    if MASKED:
        # NOTE: rows past the context may hold anything (even NaN); p is 0 there, so zero them.
        v = tl.where(t_ok[:, None], v, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# NOTE: index tensors sit at step-dependent offsets of one packed buffer, a block table is as wide
# as the step needs and a window differs per group: not specializing on them keeps one compiled
# variant whatever the step (the engine warms it when built).
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr, kv_ptr, kv_desc, scale_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_ml_ptr, part_acc_ptr, out_ptr,
    qk_scale, v_scale, window, tokens_per_split, num_splits, num_kv_heads, table_hi,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kn, stride_kc,
    stride_bt, stride_ot, stride_oh, stride_sb, stride_sh, stride_sn,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD: tl.constexpr, HEAD_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE: tl.constexpr, SINGLE: tl.constexpr, WINDOWED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, QUANT: tl.constexpr,
    WIDEN: tl.constexpr, STAGE_V: tl.constexpr,
):
    if TMA:  # NOTE: a 1-D grid, KV head fastest: the heads of one request run side by side
        pid = tl.program_id(0)
        kv_head = pid % num_kv_heads
        split = (pid // num_kv_heads) % num_splits
        req = pid // (num_kv_heads * num_splits)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    # NOTE: no early return for idle requests and no seq_len in the first tile's table
    # address (without a window): the start-up loads are issued together, not in a chain.
    q_row = tl.load(query_start_loc_ptr + req)
    has_query = tl.load(query_start_loc_ptr + req + 1) > q_row
    seq_len = tl.load(seq_lens_ptr + req)
    if WINDOWED:
        ctx_start = tl.maximum(seq_len - window, 0)
        # NOTE: splits are laid out from a TILE-aligned origin so every tile is aligned.
        first = (ctx_start // TILE) * TILE + split * tokens_per_split
        lo = tl.maximum(first, ctx_start)
    else:
        first = split * tokens_per_split
        lo = first
    # NOTE: the last split runs to seq_len even past the host's max_seq_len (a CUDA graph
    # captured for shorter contexts stays correct, only less balanced).
    end = tl.where(split == num_splits - 1, seq_len, first + tokens_per_split)
    hi = tl.where(has_query, tl.minimum(end, seq_len), first)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q_off = q_row.to(tl.int64) * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :]
    # NOTE: an idle request's rows are all masked (a comparison, not `has_query & ...`:
    # the interpreter rejects a scalar-and-tensor mask).
    q_ok = g < tl.where(has_query, GROUP, 0)
    q = tl.load(q_ptr + q_off, mask=q_ok[:, None] & (d[None, :] < HEAD), other=0.0).to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DV_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    scale_head = scale_ptr + kv_head.to(tl.int64) * stride_sh
    if TMA:
        # Only a split's partial first and last tiles are masked.
        full_lo = tl.where(lo == first, first, first + TILE)
        full_hi = tl.maximum((hi // TILE) * TILE, full_lo)
        common = (table_row, kv_head)
        scaling = (qk_scale, v_scale, scale_head, stride_sb, stride_sn)
        if (lo != first) & (lo < hi):
            m_i, l_i, acc = _decode_tile_tma(q, m_i, l_i, acc, kv_desc, *common, first, lo, hi, *scaling,
                                             HEAD, HEAD_V, BLOCK_N, TILE, DOT_DTYPE, DOT_PRECISION, True, QUANT, WIDEN,
                                             STAGE_V)
        for start in range(full_lo, full_hi, TILE):
            m_i, l_i, acc = _decode_tile_tma(q, m_i, l_i, acc, kv_desc, *common, start, lo, hi, *scaling,
                                             HEAD, HEAD_V, BLOCK_N, TILE, DOT_DTYPE, DOT_PRECISION, False, QUANT, WIDEN,
                                             STAGE_V)
        if full_hi < hi:
            m_i, l_i, acc = _decode_tile_tma(q, m_i, l_i, acc, kv_desc, *common, full_hi, lo, hi, *scaling,
                                             HEAD, HEAD_V, BLOCK_N, TILE, DOT_DTYPE, DOT_PRECISION, True, QUANT, WIDEN,
                                             STAGE_V)
    else:
        head_base = kv_ptr + kv_head.to(tl.int64) * stride_kh
        for start in range(first, hi, TILE):
            tok = start + tl.arange(0, TILE)
            block, n = _token_blocks(table_row, tok, table_hi, BLOCK_N)
            row = block * stride_kb + n * stride_kn
            scales = scale_head + block * stride_sb + n * stride_sn
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, row, scales, (tok >= lo) & (tok < hi), head_base,
                                         qk_scale, v_scale, stride_kc, HEAD, HEAD_V, D_PAD, DV_PAD, DOT_DTYPE,
                                         DOT_PRECISION, QUANT, WIDEN, STAGE_V)

    acc = acc * v_scale  # NOTE: the per-tensor V scale (per token: 1 / max, see _scaled_probs), once
    if SINGLE:
        o_off = q_row.to(tl.int64) * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh + dv[None, :]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty),
                 mask=q_ok[:, None] & (dv[None, :] < HEAD_V))
    else:
        # Partials: [req, kv_head, split, GROUP_PAD] for (m, l) and (..., DV_PAD) for acc.
        slot = ((req * num_kv_heads + kv_head) * num_splits + split).to(tl.int64) * GROUP_PAD + g
        tl.store(part_ml_ptr + slot * 2, m_i)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i)
        tl.store(part_acc_ptr + slot[:, None] * DV_PAD + dv[None, :], acc)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["query_start_loc_ptr"])
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
