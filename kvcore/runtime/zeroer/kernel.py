"""The Triton kernel that zeroes listed blocks, and its validating launcher.

All offsets are in *vectors* of ``vec`` int32 words (4, 8 or 16 bytes) relative
to one base tensor spanning a whole allocation, so the kernel never builds a
pointer from an integer (which the Triton interpreter cannot do) and the
compiler can prove ``vec``-word alignment for wide stores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Rows of ``VEC`` words one program stores per inner-loop step.
ROWS = 256
#: Programs per streaming multiprocessor; each loops over its share of work.
PROGRAMS_PER_SM = 8
#: Warps per program.
NUM_WARPS = 2
#: Grid cap where the multiprocessor count is unknown (CPU interpreter).
CPU_MAX_PROGRAMS = 4


@triton.jit(do_not_specialize=["ids_offset", "num_ids"])
def _zero_blocks_kernel(
    base_ptr,  # int32 view of the whole allocation
    ids_ptr,  # block ids (int32 or int64): num_ids of them from ids_offset on
    ids_offset,
    num_ids,
    num_blocks,
    chunk_start_ptr,  # int64 [num_chunks]: chunk start, in vectors
    chunk_stride_ptr,  # int64 [num_chunks]: manager block stride, in vectors
    chunk_len_ptr,  # int64 [num_chunks]: chunk length, in vectors
    num_chunks,
    VEC: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, VEC)[None, :]
    zeros = tl.zeros([ROWS, VEC], dtype=tl.int32)
    total = num_ids * num_chunks
    # NOTE: a bounded grid; each program walks (id, chunk) work items.
    for item in range(pid, total, num_programs):
        which = item // num_chunks
        chunk = item - which * num_chunks
        block = tl.load(ids_ptr + ids_offset + which).to(tl.int64)
        # NOTE: ids outside [0, num_blocks) store nothing: never out of bounds.
        valid = (block >= 0) & (block < num_blocks)
        length = tl.where(valid, tl.load(chunk_len_ptr + chunk), 0)
        start = tl.load(chunk_start_ptr + chunk) + block * tl.load(chunk_stride_ptr + chunk)
        for step in range(0, length, ROWS):
            row = step + rows
            # Offsets are whole vectors (start * VEC), so stores can be VEC words wide.
            tl.store(base_ptr + (start + row) * VEC + lanes, zeros, mask=row < length)


def max_programs(device: torch.device) -> int:
    """Grid cap for ``device``: ``PROGRAMS_PER_SM`` programs per multiprocessor."""
    if device.type == "cuda":
        return _multiprocessors(device.index) * PROGRAMS_PER_SM
    return CPU_MAX_PROGRAMS


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_zero_blocks(
    base: torch.Tensor,
    ids: torch.Tensor,
    num_blocks: int,
    chunk_start: torch.Tensor,
    chunk_stride: torch.Tensor,
    chunk_len: torch.Tensor,
    vec: int,
    programs: int,
    *,
    ids_offset: int = 0,
    num_ids: int | None = None,
):
    """Zero every chunk of ids ``ids[ids_offset : ids_offset + num_ids]`` in one launch.

    Checks shapes, dtypes, devices and alignment (never the id values: the
    kernel skips ids outside ``[0, num_blocks)``). ``programs`` caps the grid.
    Returns what the Triton launch returns (the compiled kernel on GPUs).
    """
    if base.dtype != torch.int32 or base.dim() != 1 or not base.is_contiguous():
        raise ValueError(f"base must be a contiguous 1-D int32 tensor, got {base.dtype} {tuple(base.shape)}")
    if vec not in (1, 2, 4):
        raise ValueError(f"vec must be 1, 2 or 4 int32 words, got {vec}")
    if base.data_ptr() % (4 * vec):
        raise ValueError(f"base address {base.data_ptr():#x} is not {4 * vec}-byte aligned for vec={vec}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
        raise ValueError(f"ids must be a contiguous 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    num_ids = ids.numel() - ids_offset if num_ids is None else num_ids
    if ids_offset < 0 or num_ids < 0 or ids_offset + num_ids > ids.numel():
        raise ValueError(f"ids[{ids_offset}:{ids_offset + num_ids}] is outside the {ids.numel()} ids given")
    table = (chunk_start, chunk_stride, chunk_len)
    num_chunks = chunk_start.numel()
    for t in table:
        if t.dtype != torch.int64 or t.dim() != 1 or t.numel() != num_chunks:
            raise ValueError("chunk tables must be 1-D int64 tensors of one length")
    for t in (*table,):
        if t.device != base.device:
            raise ValueError(f"all tensors must live on {base.device}, got one on {t.device}")
    if ids.device != base.device and not (ids.is_pinned() and base.device.type == "cuda"):
        raise ValueError(f"ids must live on {base.device} (or in pinned host memory), got {ids.device}")
    if num_chunks == 0:
        return None
    grid = (max(1, min(programs, num_ids * num_chunks)),)
    return _zero_blocks_kernel[grid](
        base, ids, ids_offset, num_ids, num_blocks, chunk_start, chunk_stride, chunk_len, num_chunks,
        VEC=vec, ROWS=ROWS, num_warps=NUM_WARPS,
    )


class ZeroLauncher:
    """Launches over one allocation's chunk tables, which are checked once, when built.

    ``launch`` trusts its tables and takes ids its caller has checked (a
    contiguous 1-D int32/int64 tensor). The first launch of each argument
    specialization (table, ids dtype, ids 16-byte alignment) goes through the
    validating launcher and Triton's JIT; later ones call the compiled kernel
    directly, skipping the JIT's per-call argument binding.
    """

    def __init__(self, base: torch.Tensor, tables: list[tuple[torch.Tensor, ...]], num_blocks: int,
                 vec: int, programs: int) -> None:
        self.base, self.tables, self.num_blocks = base, tables, num_blocks
        self.vec, self.programs = vec, programs
        self._compiled: dict[tuple, object] = {}
        self._runners: dict[tuple, object] = {}
        #: Why direct launches of the compiled kernel were given up (None while they work).
        self.direct_launch_error: str | None = None

    def table_for(self, num_ids: int) -> tuple[torch.Tensor, ...]:
        """Coarse chunks when they fill the grid, else the finest (few ids still use every SM)."""
        coarse = self.tables[0]
        return coarse if num_ids * coarse[0].numel() >= self.programs else self.tables[-1]

    def launch(self, ids: torch.Tensor, ids_offset: int, num_ids: int, stream: int | None) -> None:
        table = self.table_for(num_ids)
        start, stride, length = table
        num_chunks = start.numel()
        if num_chunks == 0 or num_ids == 0:
            return
        key = (id(start), ids.data_ptr() % 16 == 0, ids.dtype)
        compiled = self._compiled.get(key)
        if compiled is not None and stream is not None:
            grid = min(self.programs, num_ids * num_chunks)
            runner = self._runners.get((key, grid))
            if runner is None:
                runner = self._runners[key, grid] = compiled[(grid, 1, 1)]
            try:
                runner(
                    self.base, ids, ids_offset, num_ids, self.num_blocks, start, stride, length, num_chunks,
                    self.vec, ROWS, stream=stream,
                )
                return
            except Exception as exc:  # NOTE: a Triton whose compiled-kernel call differs: keep the JIT path
                self.direct_launch_error = f"{type(exc).__name__}: {exc}"
                self._compiled = dict.fromkeys(self._compiled)
        result = launch_zero_blocks(
            self.base, ids, self.num_blocks, *table, self.vec, self.programs, ids_offset=ids_offset, num_ids=num_ids
        )
        if key not in self._compiled and callable(getattr(result, "__getitem__", None)):
            self._compiled[key] = result
