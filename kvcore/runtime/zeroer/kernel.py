"""The Triton kernel that zeroes listed blocks, its validating launcher and the hot-path launcher.

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

from kvcore.runtime.zeroer.driver_launch import DriverLaunch
from kvcore.runtime.zeroer.listed import LISTED, NO_AFFINE, affine_form, launch_listed

#: Rows of ``VEC`` words one program stores per inner-loop step.
ROWS = 256
#: Programs per streaming multiprocessor; each loops over its share of work.
PROGRAMS_PER_SM = 8
#: Warps per program.
NUM_WARPS = 2
#: Grid cap where the multiprocessor count is unknown (CPU interpreter).
CPU_MAX_PROGRAMS = 4


# NOTE: no integer argument is specialized, so the compiled kernel's parameters are always the
# seven arguments (the driver launch of ZeroLauncher relies on that, and checks it).
@triton.jit(do_not_specialize=["ids_offset", "num_ids", "num_blocks", "num_chunks"])
def _zero_blocks_kernel(
    base_ptr,  # int32 view of the whole allocation
    ids_ptr,  # block ids (int32 or int64): num_ids of them from ids_offset on
    ids_offset,
    num_ids,
    num_blocks,
    table_ptr,  # int64 [3, num_chunks]: chunk start, manager block stride, chunk length (in vectors)
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
        length = tl.where(valid, tl.load(table_ptr + 2 * num_chunks + chunk), 0)
        start = tl.load(table_ptr + chunk) + block * tl.load(table_ptr + num_chunks + chunk)
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


def chunk_table(chunk_start: torch.Tensor, chunk_stride: torch.Tensor, chunk_len: torch.Tensor) -> torch.Tensor:
    """The kernel's ``[3, num_chunks]`` int64 table from its three columns (checked)."""
    num_chunks = chunk_start.numel()
    for t in (chunk_start, chunk_stride, chunk_len):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.numel() != num_chunks:
            raise ValueError("chunk tables must be 1-D int64 tensors of one length")
        if t.device != chunk_start.device:
            raise ValueError(f"all tensors must live on {chunk_start.device}, got one on {t.device}")
    return torch.stack([chunk_start, chunk_stride, chunk_len]).contiguous()


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
    table = chunk_table(chunk_start, chunk_stride, chunk_len)
    return launch_table(base, ids, num_blocks, table, vec, programs, ids_offset=ids_offset, num_ids=num_ids)


def launch_table(base, ids, num_blocks, table, vec, programs, *, ids_offset=0, num_ids=None):
    """:func:`launch_zero_blocks` with the chunk table already stacked ``[3, num_chunks]``."""
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
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3 or not table.is_contiguous():
        raise ValueError(f"the chunk table must be a contiguous [3, chunks] int64 tensor, got {tuple(table.shape)}")
    if table.device != base.device:
        raise ValueError(f"all tensors must live on {base.device}, got one on {table.device}")
    if ids.device != base.device and not (ids.is_pinned() and base.device.type == "cuda"):
        raise ValueError(f"ids must live on {base.device} (or in pinned host memory), got {ids.device}")
    num_chunks = table.shape[1]
    if num_chunks == 0:
        return None
    grid = (max(1, min(programs, num_ids * num_chunks)),)
    return _zero_blocks_kernel[grid](
        base, ids, ids_offset, num_ids, num_blocks, table, num_chunks, VEC=vec, ROWS=ROWS, num_warps=NUM_WARPS,
    )


def _active(hook):
    """``hook``, or None when it is unset or an empty chain (Triton >= 3.5 keeps a ``HookChain`` always)."""
    if hook is None:
        return None
    calls = getattr(hook, "calls", None)
    return None if calls is not None and not calls else hook


def _launch_hooks():
    """Triton's launch hooks (profilers set them), read on every direct launch; None where none is set."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None:
        return lambda: (None, None)
    return lambda: (_active(runtime.launch_enter_hook), _active(runtime.launch_exit_hook))


class ZeroLauncher:
    """Launches over one allocation's chunk tables, which are checked once, when built.

    ``launch`` trusts its tables and takes ids its caller has checked (a
    contiguous 1-D int32/int64 tensor, or pinned host memory). The first
    launch of each argument specialization (table, ids dtype, ids 16-byte
    alignment) goes through the validating launcher and Triton's JIT. Later
    ones, with no Triton launch hook set, go straight to the CUDA driver
    (:class:`~kvcore.runtime.zeroer.driver_launch.DriverLaunch`: the compiled
    kernel, a parameter block built once, three values rewritten per call);
    where that cannot be set up or the driver refuses a launch, the compiled
    kernel's own Triton launcher serves, and where that fails too, the JIT.
    """

    def __init__(self, base: torch.Tensor, tables: list[torch.Tensor], num_blocks: int, vec: int, programs: int) -> None:
        self.base, self.tables, self.num_blocks = base, tables, num_blocks
        self.vec, self.programs = vec, programs
        self._compiled: dict[tuple, object] = {}
        self._driver: dict[tuple, DriverLaunch] = {}
        self._hooks = _launch_hooks()
        self._base_address = base.data_ptr()
        self._table_addresses = {id(t): t.data_ptr() for t in tables}
        self._num_chunks = {id(t): t.shape[1] for t in tables}
        #: Why direct launches of the compiled kernel were given up (None while they work).
        self.direct_launch_error: str | None = None
        #: Why driver launches are not used (None while they work or before the first compile).
        self.driver_launch_error: str | None = None
        #: Per table, the driver launch of the by-value kernel and its id parameters.
        self._listed: dict[int, tuple[DriverLaunch, object]] = {}
        #: Why short host lists are not passed by value (None while they are).
        self.listed_launch_error: str | None = None if num_blocks < 1 << 31 else "num_blocks needs int64 ids"
        #: Per table, its affine form (the by-value kernel then reads no table), or None.
        self._affine = {id(t): affine_form(t) for t in tables}

    def launch_list(self, ids: list[int], stream: int) -> bool:
        """Zero a checked host list of at most ``LISTED`` ids passed by value; False: stage them instead.

        The first call per chunk table compiles the by-value kernel (the
        validating launcher); later ones are driver launches. False where a
        Triton launch hook is set, the driver launch is unavailable or refused.
        """
        if self.listed_launch_error is not None:
            return False
        n = len(ids)
        table = self.table_for(n)
        entry = self._listed.get(id(table))
        if entry is None:
            result = launch_listed(self.base, ids, self.num_blocks, table, self.vec, self.programs, ROWS, NUM_WARPS,
                                   self._affine.get(id(table)))
            self._add_listed(table, result)
            return True
        enter, leave = self._hooks()
        if enter is not None or leave is not None:
            return False
        driver, values = entry
        values[:n] = ids
        driver.params[4].value = n
        status = driver(min(self.programs, n * self._num_chunks[id(table)]), stream)
        if status == 0:
            return True
        self.listed_launch_error = f"cuLaunchKernel returned CUresult {status}"
        self._listed.clear()
        return False

    def _add_listed(self, table: torch.Tensor, compiled) -> None:
        try:
            compiled[(1, 1, 1)]  # NOTE: loads the module and function handles
            values = [self._base_address, self._table_addresses[id(table)], self._num_chunks[id(table)],
                      self.num_blocks, 0, *(self._affine.get(id(table)) or NO_AFFINE)] + [0] * (LISTED // 2)
            driver = DriverLaunch(compiled, values, [True, True] + [False] * (len(values) - 2))
            self._listed[id(table)] = (driver, driver.pack_ints(len(values) - LISTED // 2, LISTED // 2, 2))
        except (ValueError, AttributeError, KeyError, TypeError) as exc:  # NOTE: host lists are staged
            self.listed_launch_error = f"{type(exc).__name__}: {exc}"

    def table_for(self, num_ids: int) -> torch.Tensor:
        """Coarse chunks when they fill the grid, else the finest (few ids still use every SM)."""
        coarse = self.tables[0]
        return coarse if num_ids * self._num_chunks[id(coarse)] >= self.programs else self.tables[-1]

    def launch(self, ids: torch.Tensor, ids_offset: int, num_ids: int, stream: int | None) -> None:
        table = self.table_for(num_ids)
        num_chunks = self._num_chunks.get(id(table))
        if num_chunks is None:
            num_chunks = table.shape[1]
        if num_chunks == 0 or num_ids == 0:
            return
        address = ids.data_ptr()
        key = (id(table), address % 16 == 0, ids.dtype)
        if stream is not None:
            driver = self._driver.get(key)
            if driver is not None and ids_offset + num_ids < driver.limit:
                enter, leave = self._hooks()
                if enter is None and leave is None:
                    params = driver.params
                    params[1].value, params[2].value, params[3].value = address, ids_offset, num_ids
                    status = driver(min(self.programs, num_ids * num_chunks), stream)
                    if status == 0:
                        return
                    # NOTE: nothing was launched (e.g. no current context on this thread): Triton serves.
                    self.driver_launch_error = f"cuLaunchKernel returned CUresult {status}"
                    self._driver.clear()
        compiled = self._compiled.get(key)
        if compiled is not None and stream is not None:
            grid = min(self.programs, num_ids * num_chunks)
            try:
                enter, leave = self._hooks()
                if enter is None and leave is None:
                    compiled.run(
                        grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                        self._base_address, address, ids_offset, num_ids, self.num_blocks,
                        self._table_addresses[id(table)], num_chunks, self.vec, ROWS,
                    )
                else:
                    compiled[(grid, 1, 1)](
                        self.base, ids, ids_offset, num_ids, self.num_blocks, table, num_chunks, self.vec, ROWS,
                        stream=stream,
                    )
                return
            except Exception as exc:  # NOTE: a Triton whose compiled-kernel call differs: keep the JIT path
                self.direct_launch_error = f"{type(exc).__name__}: {exc}"
                self._compiled = dict.fromkeys(self._compiled)
        result = launch_table(
            self.base, ids, self.num_blocks, table, self.vec, self.programs, ids_offset=ids_offset, num_ids=num_ids
        )
        if key not in self._compiled and callable(getattr(result, "__getitem__", None)):
            result[(1, 1, 1)]  # NOTE: loads the module and function handles that run needs
            self._compiled[key] = result
            if self.driver_launch_error is None:
                self._add_driver(key, result, address, table, num_chunks)

    def _add_driver(self, key: tuple, compiled, address: int, table: torch.Tensor, num_chunks: int) -> None:
        values = [self._base_address, address, 0, 0, self.num_blocks, self._table_addresses[id(table)], num_chunks]
        pointers = [True, True, False, False, False, True, False]
        try:
            self._driver[key] = DriverLaunch(compiled, values, pointers)
        except (ValueError, AttributeError, KeyError, TypeError) as exc:  # NOTE: Triton's launcher serves
            self.driver_launch_error = f"{type(exc).__name__}: {exc}"
