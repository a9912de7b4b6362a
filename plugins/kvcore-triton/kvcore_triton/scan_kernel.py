"""Mamba2's chunk outputs in one launch: for every chunk, head and token ``l`` of the chunked scan,
``y_l = sum_{s <= l} (c_l . b_s) exp(A_l - A_s) x_s + exp(A_l) (c_l . h)`` (``A`` the running sum of
``dt * a`` in the chunk, ``x`` already scaled by ``dt``, ``h`` the state entering the chunk), without
the ``[chunk, chunk]`` decay and score matrices a tensor formulation writes out per head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_output_kernel(
    c_ptr, b_ptr, x_ptr, cum_ptr, state_ptr, y_ptr, num_chunks, per, size, n_state, p_head,
    sc_k, sc_c, sc_l, sc_g, sc_n, sb_k, sb_c, sb_l, sb_g, sb_n, sx_k, sx_c, sx_l, sx_h, sx_p,
    sa_k, sa_h, sa_c, sa_l, ss_k, ss_c, ss_h, ss_p, ss_n, sy_k, sy_c, sy_l, sy_h, sy_p,
    N: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):
    kc, h, lb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k, chunk, g = (kc // num_chunks).to(tl.int64), kc % num_chunks, h // per
    l = lb * BLOCK + tl.arange(0, BLOCK)
    n, p = tl.arange(0, N), tl.arange(0, P)
    l_ok, n_ok, p_ok = l < size, n < n_state, p < p_head
    c = tl.load(c_ptr + k * sc_k + chunk * sc_c + l[:, None] * sc_l + g * sc_g + n[None, :] * sc_n,
                mask=l_ok[:, None] & n_ok[None, :], other=0.0)
    cum_base = cum_ptr + k * sa_k + h * sa_h + chunk * sa_c
    cum_l = tl.load(cum_base + l * sa_l, mask=l_ok, other=0.0)
    # NOTE: what the state entering the chunk gives each token, decayed to it
    state = tl.load(state_ptr + k * ss_k + chunk * ss_c + h * ss_h + p[:, None] * ss_p + n[None, :] * ss_n,
                    mask=p_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.dot(c, tl.trans(state), input_precision=PRECISION) * tl.exp(cum_l)[:, None]
    for start in range(0, (lb + 1) * BLOCK, BLOCK):  # NOTE: the blocks of tokens up to the diagonal
        s = start + tl.arange(0, BLOCK)
        s_ok = s < size
        b = tl.load(b_ptr + k * sb_k + chunk * sb_c + s[:, None] * sb_l + g * sb_g + n[None, :] * sb_n,
                    mask=s_ok[:, None] & n_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k * sx_k + chunk * sx_c + s[:, None] * sx_l + h * sx_h + p[None, :] * sx_p,
                    mask=s_ok[:, None] & p_ok[None, :], other=0.0)
        cum_s = tl.load(cum_base + s * sa_l, mask=s_ok, other=0.0)
        causal = (s[None, :] <= l[:, None]) & s_ok[None, :]
        decay = tl.where(causal, tl.exp(tl.minimum(cum_l[:, None] - cum_s[None, :], 0.0)), 0.0)
        scores = tl.dot(c, tl.trans(b), input_precision=PRECISION) * decay
        acc += tl.dot(scores, x, input_precision=PRECISION)
    tl.store(y_ptr + k * sy_k + chunk * sy_c + l[:, None] * sy_l + h * sy_h + p[None, :] * sy_p, acc,
             mask=l_ok[:, None] & p_ok[None, :])


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_outputs(c: torch.Tensor, b: torch.Tensor, x: torch.Tensor, cumsum: torch.Tensor,
                  entering: torch.Tensor) -> torch.Tensor:
    """``y`` ``[k, chunks, size, H, P]`` (float32) of the chunked scan from its float32 pieces: ``c``,
    ``b`` ``[k, chunks, size, G, N]``, ``x`` ``[k, chunks, size, H, P]`` (scaled by ``dt``),
    ``cumsum`` ``[k, H, chunks, size]`` (running sums of ``dt * a`` per chunk) and ``entering``
    ``[k, chunks, H, P, N]`` (the state entering each chunk), any strides."""
    k, num, size, heads, p = x.shape
    groups, n = c.shape[3:]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    block = 16 if size <= 16 else 32
    grid = (k * num, heads, triton.cdiv(size, block))
    _chunk_output_kernel[grid](
        c, b, x, cumsum, entering, y, num, heads // groups, size, n, p,
        *c.stride(), *b.stride(), *x.stride(), *cumsum.stride(), *entering.stride(), *y.stride(),
        N=_pad(n), P=_pad(p), BLOCK=block,
        # NOTE: float32 products as float32 (TF32 would move float32 models off transformers' tokens)
        PRECISION="ieee",
        num_warps=4,
    )
    return y
