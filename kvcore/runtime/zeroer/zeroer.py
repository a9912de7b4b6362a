"""KVBlockZeroer: clear newly allocated manager blocks in every layer, in one launch, with host
ids staged through one persistent pinned buffer (docs/zeroer.md)."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.runtime.zeroer import inputs
from kvcore.runtime.zeroer.inputs import host_ids, id_list, tensor_ids
from kvcore.settings import Settings

#: Largest run one kernel work item zeroes, and the finer chunks used when few ids leave SMs idle.
CHUNK_BYTES, FINE_CHUNK_BYTES = 32 * 1024, 4 * 1024
_BACKENDS = ("auto", "triton", "torch")
#: Id staging: parts (one event each), ids per part at first, alignment of a staged list (16 ids: 128 bytes).
PARTS, PART_IDS, ALIGN = 4, 4096, 16
#: The raw handle of device ``index``'s current CUDA stream (no Stream object built).
current_stream_id = getattr(torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream)


@functools.cache
def _kernel():
    """The Triton kernel module, imported late (Triton reads TRITON_INTERPRET then); None without Triton."""
    try:
        from kvcore.runtime.zeroer import kernel
        return kernel
    except ImportError:  # NOTE: the torch fallback serves then
        return None


class IdBuffer:
    """One zeroer's pinned id buffer and its device copy (CUDA); :meth:`stage` gives the ids' slice."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        self._events = [torch.cuda.Event() for _ in range(PARTS)]
        self._stream_id, self._stream = None, None
        self._allocate(PART_IDS)

    def _allocate(self, part_ids: int) -> None:
        self.part_ids = part_ids
        self.pinned = torch.zeros(PARTS * part_ids, dtype=torch.int64, pin_memory=True)
        self.mirror = torch.zeros(PARTS * part_ids, dtype=torch.int64, device=self.device)
        self._host = memoryview(self.pinned.numpy()).cast("B").cast("q")  # NOTE: lists are written with no tensor
        self._recorded, self._part, self._used = [False] * PARTS, 0, 0

    def refuse_capture(self) -> None:
        """``ValueError`` during CUDA graph capture: host ids would be baked into the graph."""
        if self._capturing():
            raise ValueError("host block ids cannot be zeroed inside CUDA graph capture (the graph would keep stale "
                             "ids); write them into zeroer.block_id_buffer(n) and capture zero_block_ids(buf[:n])")

    def stage(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Copy checked ``ids`` to the device buffer (async, on the current stream)."""
        n, stream_id = len(ids), current_stream_id(self.device.index)
        if n > self.part_ids:
            torch.cuda.synchronize(self.device)  # NOTE: rare; the old buffers may still feed queued work
            self._allocate(max(2 * self.part_ids, -(-n // ALIGN) * ALIGN))
        if stream_id != self._stream_id:
            if self._stream is not None:
                self._leave_part()  # NOTE: the old stream's work ends the part, under its own event
            self._stream_id, self._stream = stream_id, torch.cuda.current_stream(self.device)
        if self._used + n > self.part_ids:
            self._leave_part()
        start = self._part * self.part_ids + self._used
        self._used += -(-n // ALIGN) * ALIGN
        if isinstance(ids, torch.Tensor):
            self.pinned[start : start + n].copy_(ids)
        else:
            self._host[start : start + n] = array("q", ids)
        return self.mirror[start : start + n].copy_(self.pinned[start : start + n], non_blocking=True)

    def _leave_part(self) -> None:
        self._events[self._part].record(self._stream)
        self._recorded[self._part] = True
        self._part, self._used = (self._part + 1) % PARTS, 0
        if self._recorded[self._part]:
            self._events[self._part].synchronize()  # NOTE: blocks only a whole buffer behind the host


class KVBlockZeroer:
    """Zero listed manager blocks in every layer's cache with one kernel launch per allocation.

    ``backend``: ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``), ``"torch"`` (an
    indexed fill per segment) or ``"auto"``. ``num_blocks`` is settable up to ``max_num_blocks``.
    """

    def __init__(self, device: torch.device | str, attn_groups: Iterable[Any], kernel_block_sizes: list[int | None],
                 kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                 runner_only_attn_layers: Iterable[str] | None = None, *, backend: str = "auto",
                 settings: Settings | None = None) -> None:
        num_blocks = positive_int("num_blocks", num_blocks)
        views = inputs.views_of_groups(attn_groups, kernel_block_sizes, kv_caches, num_blocks, runner_only_attn_layers)
        self._build(device, views, num_blocks, backend, settings)

    @classmethod
    def from_views(cls, device: torch.device | str, views: Mapping[str, tuple[torch.Tensor, int]], num_blocks: int,
                   *, backend: str = "auto", settings: Settings | None = None) -> KVBlockZeroer:
        """A zeroer over ``views``: layer -> ``(view as allocated, rows_per_block)``, no runner-only layers."""
        num_blocks = positive_int("num_blocks", num_blocks)
        zeroer = cls.__new__(cls)
        zeroer._build(device, inputs.checked_views(views, num_blocks), num_blocks, backend, settings)
        return zeroer

    def _build(self, device: Any, views: Mapping, num_blocks: int, backend: str, settings: Settings | None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend not in _BACKENDS:
            raise ValueError(f"Unsupported zeroer backend: {backend!r}. Supported: {list(_BACKENDS)}")
        self._allocations = inputs.allocations(views, num_blocks, self.device, (CHUNK_BYTES, FINE_CHUNK_BYTES))
        interpret = (settings or Settings.from_env()).triton_interpret
        # NOTE: with the interpreter on, it runs the kernel for CUDA tensors too
        runnable = _kernel() is not None and (self.device.type == "cuda" or (self.device.type == "cpu" and interpret)
                                              ) and (not interpret or _kernel().interpreter_runs())
        if backend == "triton" and self._allocations and not runnable:
            raise ValueError(f"the Triton zeroing kernel cannot run on {self.device} here; install triton, set "
                             "TRITON_INTERPRET=1 before importing triton to run it on CPU (with a Triton whose "
                             "interpreter runs its loops), or pass backend='torch'")
        self.backend = backend if backend != "auto" else ("triton" if runnable or not self._allocations else "torch")
        self.max_num_blocks = num_blocks
        self._ids = torch.empty(0, dtype=torch.int64, device=self.device)
        cuda = self.backend == "triton" and self.device.type == "cuda"
        self._id_buffer = IdBuffer(self.device) if cuda and self._allocations else None
        self.num_blocks = num_blocks

    @property
    def num_blocks(self) -> int:
        """Ids accepted are ``[0, num_blocks)``; settable from 1 to ``max_num_blocks`` (an elastic cache)."""
        return self._num_blocks

    @num_blocks.setter
    def num_blocks(self, value: int) -> None:
        value = positive_int("num_blocks", value)
        if value > self.max_num_blocks:
            raise ValueError(f"num_blocks={value} is more than the {self.max_num_blocks} blocks the zeroer's views "
                             "hold; build a zeroer over views of that many blocks")
        self._num_blocks = value
        kernel = _kernel() if self.backend == "triton" and self._allocations else None
        programs = kernel.max_programs(self.device) if kernel is not None else 0
        self._launchers = [kernel.ZeroLauncher(a.base, a.tables, value, a.vec_bytes // 4, programs)
                           for a in self._allocations if kernel is not None]

    @property
    def segments(self) -> list[inputs.Segment]:
        """Merged segments of every allocation (byte offsets relative to each allocation)."""
        return [s for a in self._allocations for s in a.segments]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one manager block occupies across all zeroed layers."""
        return sum(s.page for s in self.segments)

    def block_id_buffer(self, capacity: int) -> torch.Tensor:
        """The persistent int64 device buffer of at least ``capacity`` ids, for CUDA graphs.

        Write ids into ``buf[:n]``, capture ``zero_block_ids(buf[:n])``, then rewrite ``buf[:n]`` and
        replay. The buffer is reallocated (breaking captured graphs) only when it grows.
        """
        capacity = non_negative_int("capacity", capacity)
        if self._ids.numel() < capacity:
            self._ids = torch.empty(max(capacity, 2 * self._ids.numel(), 16), dtype=torch.int64, device=self.device)
        return self._ids

    def zero_block_ids(self, block_ids: Any, *, validate: bool = False) -> None:
        """Zero manager blocks ``block_ids`` in every layer; refused host ids write nothing.

        On CUDA up to 64 listed ids go by value, more through the persistent :class:`IdBuffer`
        (no allocation, no sync); a device tensor is used as is (graph-capturable; ids out of
        range are skipped, or raise with ``validate=True``: a sync).
        """
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            if block_ids.device != self.device:
                raise ValueError(f"block ids live on {block_ids.device}, the caches on {self.device}; move them there")
            ids = tensor_ids(block_ids, self.num_blocks, validate)
            return self._launch(ids, ids.numel()) if ids.numel() else None
        kernel = _kernel() if self.backend == "triton" and self._allocations else None
        ids = block_ids if type(block_ids) is list else None
        # NOTE: up to 64 plain ids go by value, checked as packed; anything else is checked (and
        # turned into plain ids) first
        words = kernel.listed_words(ids, self.num_blocks) if kernel and ids is not None else None
        if words is None:
            ids = id_list(ids, self.num_blocks) if ids is not None else host_ids(block_ids, self.num_blocks)
            if len(ids) == 0 or not self._allocations:
                return None
            words = kernel.listed_words(ids, self.num_blocks) if kernel and type(ids) is list else None
        if self._id_buffer is not None:
            self._id_buffer.refuse_capture()
        if words is not None:
            return self._launch(None, len(ids), words)
        if self._id_buffer is not None:
            return self._launch(self._id_buffer.stage(ids), len(ids))
        return self._launch(torch.as_tensor(ids, dtype=torch.int64).to(self.device), len(ids))

    def _launch(self, ids: torch.Tensor | None, num_ids: int, words: list[int] | None = None) -> None:
        if self.backend == "torch":  # NOTE: the fallback: one indexed fill per segment, ids out of range skipped
            keep = ids[(ids >= 0) & (ids < self.num_blocks)].long()
            for alloc in self._allocations:
                for seg in alloc.segments:
                    rows = alloc.bytes.as_strided((self.num_blocks, seg.page), (seg.block_stride, 1), seg.offset)
                    rows.index_fill_(0, keep, 0)
        stream = current_stream_id(self.device.index) if self.device.type == "cuda" else None
        for launcher in self._launchers:
            launcher.launch(ids, num_ids, stream, words)

    def warmup(self, num_kv_blocks: int) -> None:
        """Compile the kernel (ids by value and from memory); zero block 0 only when ``num_kv_blocks > 0``."""
        if non_negative_int("num_kv_blocks", num_kv_blocks) > 0:
            self.zero_block_ids([0])
        elif self._launchers and self.device.type == "cuda":  # NOTE: the interpreter compiles nothing
            ids = self.block_id_buffer(1)[:1]
            for alloc in self._allocations:
                for words in (None, _kernel().pack_words([0])):  # NOTE: no ids: each launch compiles, stores nothing
                    _kernel().launch_table(alloc.base, ids, self.num_blocks, alloc.tables[0], alloc.vec_bytes // 4,
                                           1, num_ids=0, words=words)
