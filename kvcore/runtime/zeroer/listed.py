"""Zeroing a short host list of blocks with the ids passed by value: no copy to the device.

A list of at most ``LISTED`` ids travels in the launch's own parameters
(``p0`` … ``p31``, two int32 ids per int64 word, the even id in the low half),
so the hot path needs neither the pinned ring nor a host-to-device copy. Each
work item picks its word by a chain of scalar selects.
Where the chunk table has an *affine form* (every chunk of one length and
block stride, starts ``origin + i*s0 + j*s1 + k*s2`` over three nested
counts, see :func:`affine_form`), the geometry travels by value too and the
kernel loads nothing before it stores. Used on CUDA through the driver launch
of :class:`~kvcore.runtime.zeroer.kernel.ZeroLauncher`; the validating
launcher here serves the first launch (it compiles the kernel) and the
interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Most ids one launch takes by value (two per 64-bit parameter).
LISTED = 64
_AFFINE = ["origin", "block_stride", "chunk_len", "n0", "s0", "n1", "s1", "s2"]
_INTS = ["num_chunks", "num_blocks", "num_ids"] + _AFFINE + [f"p{k}" for k in range(LISTED // 2)]
#: The affine form's values when the table is used instead (ignored by the kernel then).
NO_AFFINE = (0, 0, 0, 1, 0, 1, 0, 0)


# NOTE: no integer argument is specialized: the compiled kernel's parameters are always the arguments.
@triton.jit(do_not_specialize=_INTS)
def _zero_listed_kernel(
    base_ptr,  # int32 view of the whole allocation
    table_ptr,  # int64 [3, num_chunks]: chunk start, manager block stride, chunk length (in vectors)
    num_chunks,
    num_blocks,
    num_ids,  # the first num_ids ids are zeroed; the others are ignored
    origin, block_stride, chunk_len, n0, s0, n1, s1, s2,  # the table's affine form (AFFINE only)
    p0, p1, p2, p3, p4, p5, p6, p7,  # ids by value, two per word (see pack_words)
    p8, p9, p10, p11, p12, p13, p14, p15,
    p16, p17, p18, p19, p20, p21, p22, p23,
    p24, p25, p26, p27, p28, p29, p30, p31,
    VEC: tl.constexpr,
    ROWS: tl.constexpr,
    AFFINE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, VEC)[None, :]
    zeros = tl.zeros([ROWS, VEC], dtype=tl.int32)
    total = num_ids * num_chunks
    for item in range(pid, total, num_programs):
        which = item // num_chunks
        chunk = item - which * num_chunks
        pair = which // 2
        word = p0
        word = tl.where(pair == 1, p1, word)
        word = tl.where(pair == 2, p2, word)
        word = tl.where(pair == 3, p3, word)
        word = tl.where(pair == 4, p4, word)
        word = tl.where(pair == 5, p5, word)
        word = tl.where(pair == 6, p6, word)
        word = tl.where(pair == 7, p7, word)
        word = tl.where(pair == 8, p8, word)
        word = tl.where(pair == 9, p9, word)
        word = tl.where(pair == 10, p10, word)
        word = tl.where(pair == 11, p11, word)
        word = tl.where(pair == 12, p12, word)
        word = tl.where(pair == 13, p13, word)
        word = tl.where(pair == 14, p14, word)
        word = tl.where(pair == 15, p15, word)
        word = tl.where(pair == 16, p16, word)
        word = tl.where(pair == 17, p17, word)
        word = tl.where(pair == 18, p18, word)
        word = tl.where(pair == 19, p19, word)
        word = tl.where(pair == 20, p20, word)
        word = tl.where(pair == 21, p21, word)
        word = tl.where(pair == 22, p22, word)
        word = tl.where(pair == 23, p23, word)
        word = tl.where(pair == 24, p24, word)
        word = tl.where(pair == 25, p25, word)
        word = tl.where(pair == 26, p26, word)
        word = tl.where(pair == 27, p27, word)
        word = tl.where(pair == 28, p28, word)
        word = tl.where(pair == 29, p29, word)
        word = tl.where(pair == 30, p30, word)
        word = tl.where(pair == 31, p31, word)
        # NOTE: 31 bits of each half: ids are below 2**31, and bit 63 may mark the word as int64.
        block = tl.where(which % 2 == 1, word >> 32, word) & 0x7FFFFFFF
        block = block.to(tl.int64)
        # NOTE: ids outside [0, num_blocks) store nothing: never out of bounds.
        valid = (block >= 0) & (block < num_blocks)
        if AFFINE:
            inner = chunk % n0
            rest = chunk // n0
            length = tl.where(valid, chunk_len, 0)
            start = (origin + inner.to(tl.int64) * s0 + (rest % n1).to(tl.int64) * s1
                     + (rest // n1).to(tl.int64) * s2 + block * block_stride)
        else:
            length = tl.where(valid, tl.load(table_ptr + 2 * num_chunks + chunk), 0)
            start = tl.load(table_ptr + chunk) + block * tl.load(table_ptr + num_chunks + chunk)
        for step in range(0, length, ROWS):
            row = step + rows
            tl.store(base_ptr + (start + row) * VEC + lanes, zeros, mask=row < length)


def affine_form(table: torch.Tensor) -> tuple[int, ...] | None:
    """``(origin, block_stride, chunk_len, n0, s0, n1, s1, s2)`` that rebuilds ``table`` exactly, or None.

    Chunk ``c`` starts at ``origin + (c % n0)*s0 + ((c // n0) % n1)*s1 +
    (c // (n0*n1))*s2``; every chunk has one length and block stride. Only a
    form that reproduces every start is returned, so the kernel stores
    exactly where the (checked) table says.
    """
    starts, strides, lengths = (table[k].tolist() for k in range(3))
    n = len(starts)
    if n == 0 or len(set(strides)) != 1 or len(set(lengths)) != 1:
        return None

    def run(step: int, count: int) -> tuple[int, int]:
        if count == 1:
            return 1, 0
        stride = starts[step] - starts[0]
        length = 2
        while length < count and starts[length * step] - starts[(length - 1) * step] == stride:
            length += 1
        return length, stride

    n0, s0 = run(1, n)
    n1, s1 = run(n0, n // n0) if n % n0 == 0 else (0, 0)
    if n1 == 0 or (n // n0) % n1:
        return None
    s2 = starts[n0 * n1] - starts[0] if n > n0 * n1 else 0
    form = (starts[0], strides[0], lengths[0], n0, s0, n1, s1, s2)
    rebuilt = [starts[0] + (c % n0) * s0 + ((c // n0) % n1) * s1 + (c // (n0 * n1)) * s2 for c in range(n)]
    if rebuilt != starts or min(form) < 0 or max(form) >= 1 << 63:
        return None
    return form


def pack_words(ids: list[int]) -> list[int]:
    """``ids`` (below 2**31) padded to ``LISTED``, two per int64 word, each word with bit 63 set.

    The set top bit makes every word a negative int64, so Triton's JIT types
    the parameters int64 whatever the ids (the kernel keeps 31 bits of each
    half); the driver launch writes the ids straight into the words' halves.
    """
    padded = list(ids) + [0] * (LISTED - len(ids))
    return [(padded[k] | padded[k + 1] << 32) - (1 << 63) for k in range(0, LISTED, 2)]


def launch_listed(base: torch.Tensor, ids: list[int], num_blocks: int, table: torch.Tensor, vec: int,
                  programs: int, rows: int, num_warps: int, affine: tuple[int, ...] | None = None):
    """Zero blocks ``ids`` (1 to ``LISTED`` ints below 2**31) over ``table``, checked; the launch's result.

    ``affine``: :func:`affine_form` of ``table`` (then the kernel reads no table), or None.
    """
    if base.dtype != torch.int32 or base.dim() != 1 or not base.is_contiguous() or base.data_ptr() % (4 * vec):
        raise ValueError(f"base must be a contiguous 1-D int32 tensor aligned for vec={vec}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3 or table.device != base.device:
        raise ValueError(f"the chunk table must be a [3, chunks] int64 tensor on {base.device}")
    if not 0 < len(ids) <= LISTED or any(not 0 <= i < 1 << 31 for i in ids):
        raise ValueError(f"pass 1 to {LISTED} non-negative int32 ids, got {len(ids)}")
    if affine is not None and affine != affine_form(table):
        raise ValueError("affine must be affine_form(table)")
    num_chunks = table.shape[1]
    grid = (max(1, min(programs, len(ids) * num_chunks)),)
    return _zero_listed_kernel[grid](
        base, table, num_chunks, num_blocks, len(ids), *(affine or NO_AFFINE), *pack_words(ids),
        VEC=vec, ROWS=rows, AFFINE=affine is not None, num_warps=num_warps,
    )
