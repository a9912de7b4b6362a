"""KVBlockZeroer: clear newly allocated manager blocks in every layer, in one launch."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.runtime.zeroer.from_groups import checked_view, views_of_groups
from kvcore.runtime.zeroer.ids import device_ids, host_ids, id_list
from kvcore.runtime.zeroer.segments import Segment, allocation_segments, chunk_table, vector_bytes
from kvcore.runtime.zeroer.staging import HostIdStaging, current_stream_id
from kvcore.settings import Settings

#: Largest run one kernel work item zeroes, and the finer chunks used when few ids leave SMs idle.
CHUNK_BYTES, FINE_CHUNK_BYTES = 32 * 1024, 4 * 1024
_BACKENDS = ("auto", "triton", "torch")


@functools.cache
def _kernel_module():
    """The Triton kernel module, or None without Triton (the torch fallback serves then)."""
    try:
        from kvcore.runtime.zeroer import kernel
    except ImportError:  # NOTE: optional heavy dependency
        return None
    return kernel


class _Allocation:
    """One allocation's merged segments, as bytes, int32 vectors and the kernel's chunk tables."""

    def __init__(self, storage: torch.UntypedStorage, segments: list[Segment], device: torch.device) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.base = self.bytes[: storage.nbytes() // 4 * 4].view(torch.int32)
        self.segments = segments
        self.vec_bytes = vector_bytes(segments, storage.data_ptr())
        self.tables = [chunk_table(segments, size, self.vec_bytes, device) for size in (CHUNK_BYTES, FINE_CHUNK_BYTES)]


class KVBlockZeroer:
    """Zero listed manager blocks in every layer's cache with one kernel launch.

    Built once after the caches are allocated, from each layer's view and how
    many consecutive view rows form one manager block (:meth:`from_views`), or
    from the seed's arguments: attention groups (flat or one list per KV cache
    group), kernel block sizes and ``kv_caches`` (layer name -> tensor). Every
    view becomes segments (:mod:`kvcore.runtime.zeroer.segments`), merged per
    allocation; runs, offsets and strides must be multiples of 4 bytes.

    ``backend``: ``"triton"`` (the kernel; on CPU only under
    ``TRITON_INTERPRET=1``), ``"torch"`` (one indexed fill per segment, slow,
    for machines without Triton), or ``"auto"`` (Triton when it can run).
    A host list of at most 64 ids travels by value in the launch; longer ones
    and CPU tensors go through a persistent pinned buffer and its device copy
    (:mod:`kvcore.runtime.zeroer.staging`). ``num_blocks`` may be lowered or
    raised again up to the blocks the views hold (``max_num_blocks``).
    """

    def __init__(
        self,
        device: torch.device | str,
        attn_groups: Iterable[Any],
        kernel_block_sizes: list[int | None],
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        runner_only_attn_layers: Iterable[str] | None = None,
        *,
        backend: str = "auto",
        settings: Settings | None = None,
    ) -> None:
        num_blocks = positive_int("num_blocks", num_blocks)
        views = views_of_groups(attn_groups, kernel_block_sizes, kv_caches, num_blocks, runner_only_attn_layers)
        self._build(device, views, num_blocks, backend, settings or Settings.from_env())

    @classmethod
    def from_views(
        cls,
        device: torch.device | str,
        views: Mapping[str, tuple[torch.Tensor, int]],
        num_blocks: int,
        *,
        backend: str = "auto",
        settings: Settings | None = None,
    ) -> KVBlockZeroer:
        """A zeroer over ``views``: layer name -> ``(view, rows_per_block)``.

        Each view is a layer's view as allocated (``allocate_kv_cache``,
        ``KVCache.kv_caches``), attention and state caches alike, with
        ``view.shape[0] == num_blocks * rows_per_block``: ``rows_per_block`` is
        the split ratio of a dense group split into kernel blocks at
        allocation, 1 otherwise. Pass only layers with layer views (no raw
        buffers) and no runner-only layers.
        """
        num_blocks = positive_int("num_blocks", num_blocks)
        if not isinstance(views, Mapping):
            raise TypeError(f"views must map layer names to (view, rows_per_block), got {type(views).__name__}")
        checked = {name: checked_view(name, entry, num_blocks) for name, entry in views.items()}
        zeroer = cls.__new__(cls)
        zeroer._build(device, checked, num_blocks, backend, settings or Settings.from_env())
        return zeroer

    def _build(self, device: Any, views: Mapping, num_blocks: int, backend: str, settings: Settings) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend not in _BACKENDS:
            raise ValueError(f"Unsupported zeroer backend: {backend!r}. Supported: {list(_BACKENDS)}")
        for name, (view, _) in views.items():
            if view.device != self.device:
                raise ValueError(
                    f"layer {name!r} lives on {view.device}, the zeroer on {self.device}; "
                    "build the zeroer on the caches' device"
                )
        self._allocations = [_Allocation(storage, segments, self.device)
                             for storage, segments in allocation_segments(views, num_blocks, "KVBlockZeroer")]
        runnable = self.device.type == "cuda" or (self.device.type == "cpu" and settings.triton_interpret)
        if backend == "triton" and self._allocations and not (runnable and _kernel_module()):
            raise ValueError(
                f"the Triton zeroing kernel cannot run on {self.device} here; install triton, "
                "set TRITON_INTERPRET=1 before importing triton to run it on CPU, or pass backend='torch'"
            )
        auto = "triton" if runnable and _kernel_module() else "torch"
        self.backend = "triton" if not self._allocations and backend != "torch" else backend.replace("auto", auto)
        self.max_num_blocks = num_blocks
        self._ids = torch.empty(0, dtype=torch.int64, device=self.device)
        self._staging = HostIdStaging(self.device) if self.backend == "triton" and self.device.type == "cuda" else None
        self.num_blocks = num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks ids may name: ``[0, num_blocks)``; settable up to ``max_num_blocks`` (an elastic cache)."""
        return self._num_blocks

    @num_blocks.setter
    def num_blocks(self, value: int) -> None:
        value = positive_int("num_blocks", value)
        if value > self.max_num_blocks:
            raise ValueError(
                f"num_blocks={value} is more than the {self.max_num_blocks} blocks the zeroer's views hold; "
                "build a zeroer over views of that many blocks"
            )
        self._num_blocks = value
        self._launchers = []
        if self.backend == "triton" and self._allocations:
            kernel = _kernel_module()
            programs = kernel.max_programs(self.device)
            self._launchers = [kernel.ZeroLauncher(a.base, a.tables, value, a.vec_bytes // 4, programs)
                               for a in self._allocations]

    @property
    def segments(self) -> list[Segment]:
        """Merged segments of every allocation (byte offsets relative to each allocation)."""
        return [s for a in self._allocations for s in a.segments]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one manager block occupies across all zeroed layers."""
        return sum(s.page for s in self.segments)

    def block_id_buffer(self, capacity: int) -> torch.Tensor:
        """The persistent int64 device buffer of at least ``capacity`` ids.

        For CUDA graphs: write ids into ``buf[:n]``, capture
        ``zero_block_ids(buf[:n])``, then rewrite ``buf[:n]`` and replay. The
        buffer is reallocated (breaking captured graphs) only when it grows.
        """
        capacity = non_negative_int("capacity", capacity)
        if self._ids.numel() < capacity:
            self._ids = torch.empty(max(capacity, 2 * self._ids.numel(), 16), dtype=torch.int64, device=self.device)
        return self._ids

    def zero_block_ids(self, block_ids: Any, *, validate: bool = False) -> None:
        """Zero manager blocks ``block_ids`` in every layer, in one launch per allocation.

        Ints, lists, tuples, ranges, NumPy and CPU integer tensors are checked
        on the host: integers in ``[0, num_blocks)`` (bools, floats, mappings
        are refused), else ``ValueError``/``TypeError`` and nothing written. On
        CUDA this neither allocates nor waits for the device. An integer tensor
        on the zeroer's CUDA device is used as is (no host sync,
        graph-capturable); the kernel skips ids out of range, and
        ``validate=True`` checks them on the host first (one sync).
        """
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            ids = device_ids(block_ids, self.device, self.num_blocks, validate)
            if ids.numel():
                self._launch(ids, ids.numel(), None)
            return
        ids = id_list(block_ids, self.num_blocks) if type(block_ids) is list else host_ids(block_ids, self.num_blocks)
        if len(ids) == 0:
            return
        if self.backend == "torch":
            self._fill(torch.as_tensor(ids, dtype=torch.int64).to(self.device))
            return
        if self._staging is not None:
            self._staging.refuse_capture()
        if len(ids) <= _kernel_module().LISTED and type(ids) is list and self.num_blocks <= 1 << 31:
            self._launch(None, len(ids), _kernel_module().pack_words(ids))
        elif self._staging is not None:
            self._launch(self._staging.stage(ids), len(ids), None)
        else:
            self._launch(torch.as_tensor(ids, dtype=torch.int64), len(ids), None)

    def _launch(self, ids: torch.Tensor | None, num_ids: int, words: tuple[int, ...] | None) -> None:
        stream = current_stream_id(self.device.index) if self.device.type == "cuda" else None
        for launcher in self._launchers:
            launcher.launch(ids, num_ids, stream, words)

    def _fill(self, ids: torch.Tensor) -> None:
        """The torch fallback: one indexed fill per segment (ids out of range skipped)."""
        keep = ids[(ids >= 0) & (ids < self.num_blocks)]
        for alloc in self._allocations:
            for seg in alloc.segments:
                rows = alloc.bytes.as_strided((self.num_blocks, seg.page), (seg.block_stride, 1), seg.offset)
                rows.index_fill_(0, keep, 0)

    def warmup(self, num_kv_blocks: int) -> None:
        """Compile the kernel; zero block 0 only when ``num_kv_blocks > 0``."""
        if non_negative_int("num_kv_blocks", num_kv_blocks) > 0:
            self.zero_block_ids([0])
        elif self._launchers:
            kernel = _kernel_module()
            for alloc in self._allocations:  # NOTE: no ids: the launch compiles and stores nothing
                kernel.launch_table(alloc.base, self.block_id_buffer(1)[:1], self.num_blocks, alloc.tables[0],
                                    alloc.vec_bytes // 4, 1, num_ids=0)
