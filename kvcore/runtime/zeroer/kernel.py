"""The one Triton kernel that zeroes listed blocks, its validating launcher and its fast launcher
(ids from memory, or up to ``LISTED`` by value in the launch's parameters; docs/zeroer.md)."""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

#: Ids one launch takes by value; rows of ``VEC`` words stored per step; programs per SM (a few on CPU); warps.
LISTED, ROWS, PROGRAMS_PER_SM, CPU_MAX_PROGRAMS, NUM_WARPS = 64, 256, 8, 4, 2
NO_WORDS = (0,) * (LISTED // 2)  # NOTE: the words of a launch that reads its ids from memory
_WORDS = struct.Struct(f"<{LISTED // 2}q")
_PLAIN_INT = frozenset({int})  # NOTE: bool is no id here


# NOTE: no integer is specialized, so one compiled kernel serves every count, id and table.
@triton.jit(do_not_specialize=["num_ids", "num_blocks", "num_chunks"] + [f"p{k}" for k in range(LISTED // 2)])
def _zero_blocks_kernel(
    base_ptr, ids_ptr, num_ids, num_blocks,  # int32 view of the allocation; int32/int64 ids unless BY_VALUE
    table_ptr, num_chunks,  # int64 [3, num_chunks]: chunk start, manager block stride, chunk length (vectors)
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,  # ids by value (pack_words)
    p16, p17, p18, p19, p20, p21, p22, p23, p24, p25, p26, p27, p28, p29, p30, p31,
    VEC: tl.constexpr, ROWS: tl.constexpr, BY_VALUE: tl.constexpr,
):
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, VEC)[None, :]
    zeros = tl.zeros([ROWS, VEC], dtype=tl.int32)
    words = (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
             p16, p17, p18, p19, p20, p21, p22, p23, p24, p25, p26, p27, p28, p29, p30, p31)
    for item in range(tl.program_id(0), num_ids * num_chunks, tl.num_programs(0)):
        which = item // num_chunks
        chunk = item - which * num_chunks
        if BY_VALUE:
            word = p0
            for k in tl.static_range(1, 32):
                word = tl.where(which // 2 == k, words[k], word)
            # NOTE: 31 bits of each half (bit 63 may be set, see launch_table).
            block = (tl.where(which % 2 == 1, word >> 32, word) & 0x7FFFFFFF).to(tl.int64)
        else:
            block = tl.load(ids_ptr + which).to(tl.int64)
        # NOTE: ids outside [0, num_blocks) store nothing: never out of bounds.
        length = tl.where((block >= 0) & (block < num_blocks), tl.load(table_ptr + 2 * num_chunks + chunk), 0)
        start = tl.load(table_ptr + chunk) + block * tl.load(table_ptr + num_chunks + chunk)
        for step in range(0, length, ROWS):
            row = step + rows
            tl.store(base_ptr + (start + row) * VEC + lanes, zeros, mask=row < length)


def pack_words(ids: list[int]) -> tuple[int, ...]:
    """1 to ``LISTED`` checked ids below 2**31 as the kernel's 32 words: ids ``2k``, ``2k + 1`` in word ``k``."""
    # NOTE: little-endian: the even id is the low half
    return _WORDS.unpack(struct.pack(f"<{len(ids)}I", *ids).ljust(_WORDS.size, b"\0"))


def listed_words(ids: list, num_blocks: int) -> tuple[int, ...] | None:
    """The words of 1 to ``LISTED`` plain ints in ``[0, num_blocks)``, ``num_blocks <= 2**31``, checked as they
    are packed; None for anything else (the caller's checks then name what is wrong)."""
    if not 0 < len(ids) <= LISTED or num_blocks > 1 << 31 or not _PLAIN_INT.issuperset(map(type, ids)):
        return None
    try:
        words = pack_words(ids)  # NOTE: refuses negative ids
    except struct.error:
        return None
    return words if max(ids) < num_blocks else None


def max_programs(device: torch.device) -> int:
    """Grid cap for ``device``: ``PROGRAMS_PER_SM`` programs per multiprocessor (a few on CPU)."""
    if device.type != "cuda":
        return CPU_MAX_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def launch_table(base, ids, num_blocks, table, vec, programs, *, num_ids=None, words=None):
    """Zero ``num_ids`` blocks (``ids[:num_ids]``, or ``words`` by value) over ``table`` ``[3, chunks]``.

    Checks shapes, dtypes, devices, alignment, never id values (the kernel skips those out of range).
    """
    if base.dtype != torch.int32 or base.dim() != 1 or not base.is_contiguous() or base.data_ptr() % (4 * vec):
        raise ValueError(f"base must be a contiguous 1-D int32 tensor, {4 * vec}-byte aligned for vec={vec}; got "
                         f"{base.dtype} {tuple(base.shape)} at {base.data_ptr():#x}")
    if vec not in (1, 2, 4):
        raise ValueError(f"vec must be 1, 2 or 4 int32 words, got {vec}")
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
    # NOTE: bit 63 set: the JIT types every word int64 whatever the ids (the kernel keeps 31 bits of each half).
    words = None if words is None else [w | -(1 << 63) for w in words]
    return _zero_blocks_kernel[grid](base, ids, num_ids, num_blocks, table, table.shape[1], *(words or NO_WORDS),
                                     VEC=vec, ROWS=ROWS, BY_VALUE=words is not None, num_warps=NUM_WARPS)


@functools.cache
def interpreter_runs() -> bool:
    """Whether Triton's interpreter runs this kernel here (the interpreter of some Triton and NumPy
    pairs cannot loop to a bound given at run time: Triton 3.6 with NumPy 2.4): blocks 0 and 2 of
    three 4-word blocks, in two chunks each, zeroed from memory and by value."""
    table = torch.tensor([[0, 2], [4, 4], [2, 2]], dtype=torch.int64)
    ids, expected = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0] * 4 + [1] * 4 + [0] * 4)
    try:
        for words in (None, pack_words([0, 2])):
            base = torch.ones(12, dtype=torch.int32)
            launch_table(base, ids, 3, table, 1, 2, num_ids=2, words=words)
            if not torch.equal(base, expected.to(base.dtype)):
                return False
    except Exception:  # noqa: BLE001 - whatever the interpreter raises, the torch zeroer serves
        return False
    return True


def _hooked() -> bool:
    """Whether a Triton launch hook (a profiler's) is set (an empty HookChain is none): the JIT calls it."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class ZeroLauncher:
    """Launches over one allocation's chunk tables on checked ids: the JIT first, then the compiled
    kernel's own launcher (docs/zeroer.md says when the JIT serves again)."""

    def __init__(self, base: torch.Tensor, tables: list[torch.Tensor], num_blocks: int, vec: int, programs: int):
        self.base, self.tables, self.num_blocks, self.vec, self.programs = base, tables, num_blocks, vec, programs
        self._base_address = base.data_ptr()
        self._shapes = [(t.data_ptr(), t.shape[1]) for t in tables]  # NOTE: read on every launch
        self._compiled: dict[tuple, object] | None = {}  # NOTE: None once the compiled launcher failed

    def launch(self, ids: torch.Tensor, num_ids: int, stream: int | None, words: list[int] | None = None) -> None:
        """Zero blocks ``ids[:num_ids]``, or ``num_ids`` blocks of ``words`` by value (``ids`` unused then)."""
        which = 0 if num_ids * self._shapes[0][1] >= self.programs else -1  # NOTE: few ids: fine chunks fill the SMs
        table_address, num_chunks = self._shapes[which]
        if num_chunks == 0 or num_ids == 0:
            return
        ids = self.tables[which] if words is not None else ids
        address = table_address if words is not None else ids.data_ptr()
        key = (words is not None, ids.dtype, address % 16 == 0)
        compiled = None if self._compiled is None or stream is None else self._compiled.get(key)
        if compiled is not None and not _hooked():
            try:
                compiled.run(min(self.programs, num_ids * num_chunks), 1, 1, stream, compiled.function,
                             compiled.packed_metadata, None, None, None, self._base_address, address, num_ids,
                             self.num_blocks, table_address, num_chunks, *(words or NO_WORDS), self.vec, ROWS,
                             words is not None)
                return
            except (TypeError, ValueError, AttributeError, SystemError):
                self._compiled = None  # NOTE: a Triton whose compiled launcher differs: the JIT serves
        result = launch_table(self.base, ids, self.num_blocks, self.tables[which], self.vec, self.programs,
                              num_ids=num_ids, words=words)
        if self._compiled is not None and stream is not None and hasattr(result, "run"):
            result[(1, 1, 1)]  # NOTE: loads the module and function handles that run needs
            self._compiled[key] = result
