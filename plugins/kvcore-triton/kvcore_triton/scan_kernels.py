"""The within-chunk weights of Mamba2's chunked scan in one launch: for every chunk, head and pair
of tokens ``i >= j``, the group's score ``c_i . b_j`` times the decay ``exp(a dt_{j+1} + ... + a dt_i)``
(zero for ``j > i``). Built from PyTorch ops, the same weights take a dozen passes over a
``[chunk, chunk]`` tensor per head (the masked segment sums, their exponent, the scores repeated
for every head of a group); here they are written once, and a batched matrix product applies them.

Each row's decays are summed from its own token backwards, as a running sum over the masked
row, never as a difference of two long prefix sums: a difference would lose the short sums'
precision to the long ones' rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_triton import _checks

#: Query rows per program; each program covers a whole row of the chunk.
_ROWS = 16
#: Row width the kernel is compiled for at least (Mamba2 chunks are 256 tokens or fewer): every
#: shorter chunk, such as the engine's warm-up step, runs the same compiled kernel, masked.
_MIN_WIDTH = 256


@triton.jit(do_not_specialize=["size"])
def _decayed_scores_kernel(scores_ptr, adt_ptr, out_ptr, size, heads, per, groups,
                           BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # NOTE: one (chunk, head) per program row; int64 offsets
    chunk, head = pid // heads, pid % heads
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, BLOCK_S)
    # row i, column j: a dt of tokens j + 1 .. i, summed from i backwards
    following = tl.load(adt_ptr + pid * size + cols + 1, mask=cols + 1 < size, other=0.0)
    counted = cols[None, :] + 1 <= rows[:, None]
    segment = tl.cumsum(tl.where(counted, following[None, :], 0.0), axis=1, reverse=True)
    inside = (rows[:, None] < size) & (cols[None, :] < size)
    causal = inside & (cols[None, :] <= rows[:, None])
    offsets = rows[:, None] * size + cols[None, :]
    scores = tl.load(scores_ptr + (chunk * groups + head // per) * size * size + offsets, mask=causal, other=0.0)
    weights = tl.where(causal, tl.exp(segment) * scores, 0.0)
    tl.store(out_ptr + pid * size * size + offsets, weights.to(out_ptr.dtype.element_ty), mask=inside)


def runs_on(device: torch.device) -> bool:
    """Whether these kernels run for tensors on ``device`` (else the scan uses PyTorch ops)."""
    if _checks.INTERPRETER_ON:
        return _checks.INTERPRETED
    return device.type == "cuda"


def decayed_scores(scores: torch.Tensor, adt: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scores`` ``[B, G, S, S]`` (``c_i . b_j`` per group) and ``adt`` ``[B, H, S]`` (``a dt`` per
    token and head, ``H`` a multiple of ``G``), both float32 -> the weights ``[B, H, S, S]``, computed
    in float32 and stored as ``dtype``."""
    chunks, groups, size = scores.shape[:3]
    heads = adt.shape[1]
    if scores.dtype != torch.float32 or adt.dtype != torch.float32 or adt.shape != (chunks, heads, size) \
            or scores.shape[3] != size or heads % groups:
        raise ValueError(f"decayed_scores: want float32 scores [B, G, S, S] and a dt [B, H, S] with H a multiple "
                         f"of G, got {scores.dtype} {tuple(scores.shape)} and {adt.dtype} {tuple(adt.shape)}")
    scores, adt = scores.contiguous(), adt.contiguous()
    out = torch.empty(chunks, heads, size, size, dtype=dtype, device=scores.device)
    if out.numel():
        grid = (chunks * heads, triton.cdiv(size, _ROWS))
        _decayed_scores_kernel[grid](scores, adt, out, size, heads, heads // groups, groups,
                                     BLOCK_L=_ROWS, BLOCK_S=max(_MIN_WIDTH, triton.next_power_of_2(size)))
    return out


# NOTE: the token count, strides, flags and the lengths' address (a row of a small tensor, aligned or
# not) vary from call to call: unspecialized, so that one compiled kernel (per dtype) serves every
# call and none compiles after the engine's warm-up
@triton.jit(do_not_specialize=["lengths_ptr", "n", "s_row", "s_token", "clamp", "has_lengths"])
def _scan_dt_kernel(dt_ptr, bias_ptr, lengths_ptr, out_ptr, n, heads, s_row, s_token, low, high, clamp,
                    has_lengths, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # NOTE: one token per program: row pid // n, token pid % n
    row, token = pid // n, pid % n
    h = tl.arange(0, BLOCK_H)
    ok = h < heads
    raw = tl.load(dt_ptr + row * s_row + token * s_token + h, mask=ok, other=0.0)
    kind = raw.dtype
    bias = tl.load(bias_ptr + h, mask=ok, other=0.0).to(kind).to(tl.float32)
    value = (raw.to(tl.float32) + bias).to(kind).to(tl.float32)  # NOTE: each step rounds to dt's dtype
    # softplus (threshold 20); log1p(e) as log(1 + e) * e / ((1 + e) - 1), exact for small e
    e = tl.exp(value)
    u = 1.0 + e
    soft = tl.where(value > 20.0, value, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
    soft = soft.to(kind).to(tl.float32)
    # NOTE: vectors throughout: the interpreter refuses scalar masks
    length = tl.load(lengths_ptr + row + h * 0, mask=(h * 0 + has_lengths) != 0, other=n)
    clamped = tl.minimum(tl.maximum(soft, low), high).to(kind).to(tl.float32)
    soft = tl.where(((h * 0 + clamp) != 0) & (((h * 0 + has_lengths) == 0) | (length > 1)), clamped, soft)
    tl.store(out_ptr + pid * heads + h, tl.where(token < length, soft, 0.0), mask=ok)


def scan_dt(dt: torch.Tensor, bias: torch.Tensor, limit: tuple[float, float] | None = None,
            lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's step sizes in one launch: ``softplus(dt + bias)`` for ``dt`` ``[k, n, H]`` (last dim
    contiguous), clamped to ``limit`` (rows of one token excepted where ``lengths`` is given), and 0
    past each row's ``lengths``; returned as float32 ``[k, n, H]``, each step rounded to ``dt``'s dtype
    as the same PyTorch ops would."""
    k, n, heads = dt.shape
    if dt.stride(-1) != 1 or tuple(bias.shape) != (heads,) or (lengths is not None and tuple(lengths.shape) != (k,)):
        raise ValueError(f"scan_dt: want dt [k, n, H] with a contiguous last dim, bias [H] and lengths [k]; got "
                         f"{tuple(dt.shape)} (strides {dt.stride()}), {tuple(bias.shape)}, "
                         f"{None if lengths is None else tuple(lengths.shape)}")
    out = torch.empty(k, n, heads, dtype=torch.float32, device=dt.device)
    if out.numel():
        low, high = limit if limit is not None else (0.0, 0.0)
        given = lengths is not None
        # NOTE: an int64 pointer either way (never read without lengths)
        lengths = lengths.long() if given else torch.empty(1, dtype=torch.int64, device=dt.device)
        _scan_dt_kernel[(k * n,)](dt, bias, lengths, out, n, heads, dt.stride(0), dt.stride(1), float(low),
                                  float(high), int(limit is not None), int(given),
                                  BLOCK_H=triton.next_power_of_2(heads))
    return out
