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
