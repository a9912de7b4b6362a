"""The one Triton kernel that zeroes listed blocks, its validating launcher and its fast launcher.

Offsets are in vectors of ``VEC`` int32 words relative to one int32 base tensor
spanning a whole allocation, so the kernel never builds a pointer from an
integer (the interpreter cannot) and stores ``VEC`` words at once. A work item
is one (id, chunk) pair; a bounded grid of programs walks them. Ids are read
from ``ids_ptr``, or, for a host list of at most ``LISTED`` ids, travel by
value in the launch's parameters ``p0`` … ``p31`` (two 31-bit ids per int64
word): no copy to the device before the launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Most ids one launch takes by value (two per 64-bit parameter).
LISTED = 64
#: Rows of ``VEC`` words one program stores per inner step; programs per SM; warps per program.
ROWS, PROGRAMS_PER_SM, NUM_WARPS = 256, 8, 2
#: Grid cap where the multiprocessor count is unknown (CPU interpreter).
CPU_MAX_PROGRAMS = 4
#: The id words passed when the ids are read from memory (ignored by the kernel then).
NO_WORDS = (0,) * (LISTED // 2)


# NOTE: no integer is specialized, so one compiled kernel serves every count, id and table.
@triton.jit(do_not_specialize=["num_ids", "num_blocks", "num_chunks"] + [f"p{k}" for k in range(LISTED // 2)])
def _zero_blocks_kernel(
    base_ptr,  # int32 view of the whole allocation
    ids_ptr,  # num_ids block ids (int32 or int64), unless BY_VALUE
    num_ids,
    num_blocks,
    table_ptr,  # int64 [3, num_chunks]: chunk start, manager block stride, chunk length (in vectors)
    num_chunks,
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,  # ids by value (pack_words)
    p16, p17, p18, p19, p20, p21, p22, p23, p24, p25, p26, p27, p28, p29, p30, p31,
    VEC: tl.constexpr,
    ROWS: tl.constexpr,
    BY_VALUE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, VEC)[None, :]
    zeros = tl.zeros([ROWS, VEC], dtype=tl.int32)
    words = (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
             p16, p17, p18, p19, p20, p21, p22, p23, p24, p25, p26, p27, p28, p29, p30, p31)
    for item in range(pid, num_ids * num_chunks, num_programs):
        which = item // num_chunks
        chunk = item - which * num_chunks
        if BY_VALUE:
            word = p0
            for k in tl.static_range(1, 32):
                word = tl.where(which // 2 == k, words[k], word)
            # NOTE: 31 bits of each half: bit 63 only makes the word a negative int64 (see pack_words).
            block = (tl.where(which % 2 == 1, word >> 32, word) & 0x7FFFFFFF).to(tl.int64)
        else:
            block = tl.load(ids_ptr + which).to(tl.int64)
        # NOTE: ids outside [0, num_blocks) store nothing: never out of bounds.
        valid = (block >= 0) & (block < num_blocks)
        length = tl.where(valid, tl.load(table_ptr + 2 * num_chunks + chunk), 0)
        start = tl.load(table_ptr + chunk) + block * tl.load(table_ptr + num_chunks + chunk)
        for step in range(0, length, ROWS):
            row = step + rows
            tl.store(base_ptr + (start + row) * VEC + lanes, zeros, mask=row < length)


def pack_words(ids: list[int]) -> tuple[int, ...]:
    """1 to ``LISTED`` checked ids below 2**31 as the kernel's 32 words (bit 63 set: Triton types them int64)."""
    padded = list(ids) + [0] * (LISTED - len(ids))
    return tuple((padded[k] | padded[k + 1] << 32) - (1 << 63) for k in range(0, LISTED, 2))


@functools.lru_cache(maxsize=None)
def max_programs(device: torch.device) -> int:
    """Grid cap for ``device``: ``PROGRAMS_PER_SM`` programs per multiprocessor (a few on CPU)."""
    if device.type != "cuda":
        return CPU_MAX_PROGRAMS
    return torch.cuda.get_device_properties(device.index).multi_processor_count * PROGRAMS_PER_SM


def launch_table(base, ids, num_blocks, table, vec, programs, *, num_ids=None, words=None):
    """Zero ``num_ids`` blocks (``ids[:num_ids]``, or ``words`` by value) over ``table`` ``[3, chunks]``, checked.

    Checks shapes, dtypes, devices and alignment, never the id values (the
    kernel skips ids outside ``[0, num_blocks)``). Returns the Triton launch's
    result (the compiled kernel on GPUs).
    """
    if base.dtype != torch.int32 or base.dim() != 1 or not base.is_contiguous():
        raise ValueError(f"base must be a contiguous 1-D int32 tensor, got {base.dtype} {tuple(base.shape)}")
    if vec not in (1, 2, 4) or base.data_ptr() % (4 * vec):
        raise ValueError(f"vec must be 1, 2 or 4 int32 words and base {4 * vec}-byte aligned, got vec={vec}")
    if words is None and (ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous()):
        raise ValueError(f"ids must be a contiguous 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    num_ids = ids.numel() if num_ids is None else num_ids
    if not 0 <= num_ids <= (LISTED if words is not None else ids.numel()):
        raise ValueError(f"{num_ids} ids to zero, but {ids.numel()} given")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3 or not table.is_contiguous():
        raise ValueError(f"the chunk table must be a contiguous [3, chunks] int64 tensor, got {tuple(table.shape)}")
    if ids.device != base.device or table.device != base.device:
        raise ValueError(f"ids and table must live on {base.device}, got {ids.device} and {table.device}")
    if table.shape[1] == 0:
        return None
    grid = (max(1, min(programs, num_ids * table.shape[1])),)
    return _zero_blocks_kernel[grid](
        base, ids, num_ids, num_blocks, table, table.shape[1], *(words or NO_WORDS),
        VEC=vec, ROWS=ROWS, BY_VALUE=words is not None, num_warps=NUM_WARPS,
    )


def _hooked() -> bool:
    """Whether a Triton launch hook (a profiler's) is set: then launches take the JIT, which calls it."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    # NOTE: Triton >= 3.5 keeps a HookChain always; an empty one is no hook.
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class ZeroLauncher:
    """Launches over one allocation's chunk tables (checked once, when built) on ids its caller checked.

    The first launch of each specialization (by value or not, ids dtype and
    16-byte alignment) goes through :func:`launch_table` and Triton's JIT;
    later ones call the compiled kernel's own launcher, binding no argument.
    Where a launch hook is set or that launcher refuses (another Triton), the JIT serves.
    """

    def __init__(self, base: torch.Tensor, tables: list[torch.Tensor], num_blocks: int, vec: int, programs: int) -> None:
        self.base, self.tables, self.num_blocks, self.vec, self.programs = base, tables, num_blocks, vec, programs
        self._base_address = base.data_ptr()
        self._shapes = [(t.data_ptr(), t.shape[1]) for t in tables]  # NOTE: read on every launch
        #: Specialization -> compiled kernel; None once the compiled launcher failed.
        self._compiled: dict[tuple, object] | None = {}

    def launch(self, ids: torch.Tensor, num_ids: int, stream: int | None, words: tuple[int, ...] | None = None) -> None:
        """Zero blocks ``ids[:num_ids]``, or ``num_ids`` blocks of ``words`` by value (``ids`` unused then)."""
        # NOTE: coarse chunks when they fill the grid, else the finest (few ids still use every SM).
        which = 0 if num_ids * self._shapes[0][1] >= self.programs else -1
        table_address, num_chunks = self._shapes[which]
        if num_chunks == 0 or num_ids == 0:
            return
        ids = self.tables[which] if words is not None else ids
        address = table_address if words is not None else ids.data_ptr()
        key = (words is not None, ids.dtype, address % 16 == 0)
        compiled = None if self._compiled is None or stream is None else self._compiled.get(key)
        if compiled is not None and not _hooked():
            try:
                compiled.run(
                    min(self.programs, num_ids * num_chunks), 1, 1, stream, compiled.function,
                    compiled.packed_metadata, None, None, None, self._base_address, address, num_ids,
                    self.num_blocks, table_address, num_chunks, *(words or NO_WORDS), self.vec, ROWS, words is not None,
                )
                return
            except (TypeError, ValueError, AttributeError, SystemError):
                self._compiled = None  # NOTE: a Triton whose compiled launcher differs: the JIT serves
        result = launch_table(self.base, ids, self.num_blocks, self.tables[which], self.vec, self.programs,
                              num_ids=num_ids, words=words)
        if self._compiled is not None and stream is not None and hasattr(result, "run"):
            result[(1, 1, 1)]  # NOTE: loads the module and function handles that run needs
            self._compiled[key] = result
