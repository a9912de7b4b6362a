"""KVBlockZeroer: clear newly allocated manager blocks in every layer, in one launch."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.runtime.zeroer.from_groups import views_of_groups
from kvcore.runtime.zeroer.ids import device_ids, host_ids, id_list
from kvcore.runtime.zeroer.listed import LISTED
from kvcore.runtime.zeroer.segments import (
    Segment,
    check_segments,
    chunk_segments,
    layer_segments,
    merge_segments,
    vector_bytes,
)
from kvcore.runtime.zeroer.staging import HostIdStaging

#: Largest run one kernel work item zeroes, and the finer chunks used when few ids leave SMs idle.
CHUNK_BYTES, FINE_CHUNK_BYTES = 32 * 1024, 4 * 1024
_BACKENDS = ("auto", "triton", "torch")
#: ``KVCORE_ZEROER_STAGING``: how host ids reach the kernel on CUDA ("copy" or "mapped").
STAGING_ENV = "KVCORE_ZEROER_STAGING"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _kernel_module():
    """The Triton kernel module, or None without Triton (imported late: TRITON_INTERPRET is read then)."""
    try:
        from kvcore.runtime.zeroer import kernel
    except ImportError:  # NOTE: optional heavy dependency: the torch fallback serves without it
        return None
    return kernel


def _current_stream_getter():
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class _Allocation:
    """One allocation's merged segments and, per chunk size, its kernel tables."""

    def __init__(self, storage: torch.UntypedStorage, segments: list[Segment], device: torch.device) -> None:
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.bytes = whole
        self.base = whole[: storage.nbytes() // 4 * 4].view(torch.int32)
        self.segments = segments
        self.vec_bytes = vector_bytes(segments, storage.data_ptr())
        width = self.vec_bytes
        #: Per chunk size, the kernel's [3, chunks] table: start, block stride, length (in vectors).
        self.tables = []
        for chunk_bytes in (CHUNK_BYTES, FINE_CHUNK_BYTES):
            chunks = chunk_segments(segments, chunk_bytes)
            columns = [
                [c.offset // width for c in chunks],
                [c.block_stride // width for c in chunks],
                [c.page // width for c in chunks],
            ]
            self.tables.append(torch.tensor(columns, dtype=torch.int64, device=device).reshape(3, len(chunks)))


class KVBlockZeroer:
    """Zero listed manager blocks in every layer's cache with one kernel launch.

    Built once after the caches are allocated, from each layer's view and how
    many consecutive view rows form one manager block (:meth:`from_views`), or
    from the seed's arguments: attention groups (flat or one list per KV cache
    group), kernel block sizes and ``kv_caches`` (layer name -> tensor). Every
    view becomes segments (see :mod:`kvcore.runtime.zeroer.segments`), merged
    per allocation: layers overlaid at one address keep the widest page.
    Runs, offsets and strides must be multiples of 4 bytes (``ValueError``).

    ``backend``: ``"triton"`` (the kernel; on CPU only under
    ``TRITON_INTERPRET=1``), ``"torch"`` (one indexed fill per segment, slow,
    for machines without Triton), or ``"auto"`` (Triton when it can run).
    On CUDA, a host list of at most 64 ids travels by value in the launch's
    parameters (:mod:`kvcore.runtime.zeroer.listed`); longer ones go through
    a persistent pinned staging ring (see :mod:`kvcore.runtime.zeroer.staging`;
    ``KVCORE_ZEROER_STAGING=mapped`` lets the kernel read them from pinned
    memory instead of a device copy).
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
    ) -> None:
        num_blocks = positive_int("num_blocks", num_blocks)
        views = views_of_groups(attn_groups, kernel_block_sizes, kv_caches, num_blocks, runner_only_attn_layers)
        self._build(device, views, num_blocks, backend)

    @classmethod
    def from_views(
        cls,
        device: torch.device | str,
        views: Mapping[str, tuple[torch.Tensor, int]],
        num_blocks: int,
        *,
        backend: str = "auto",
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
        checked = {name: _checked_view(name, entry, num_blocks) for name, entry in views.items()}
        zeroer = cls.__new__(cls)
        zeroer._build(device, checked, num_blocks, backend)
        return zeroer

    def _build(self, device: Any, views: Mapping[str, tuple[torch.Tensor, int]], num_blocks: int, backend: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_blocks = num_blocks
        if backend not in _BACKENDS:
            raise ValueError(f"Unsupported zeroer backend: {backend!r}. Supported: {list(_BACKENDS)}")
        per_storage: dict[int, tuple[torch.UntypedStorage, list[Segment]]] = {}
        for name, (view, rows) in views.items():
            if view.device != self.device:
                raise ValueError(
                    f"layer {name!r} lives on {view.device}, the zeroer on {self.device}; "
                    "build the zeroer on the caches' device"
                )
            storage = view.untyped_storage()
            entry = per_storage.setdefault(storage.data_ptr(), (storage, []))
            entry[1].extend(layer_segments(view, num_blocks, rows))
        self._allocations = []
        for storage, segments in per_storage.values():
            segments = merge_segments(segments)
            check_segments(segments, num_blocks, storage.nbytes(), "KVBlockZeroer")
            self._allocations.append(_Allocation(storage, segments, self.device))
        self.backend = self._pick_backend(backend)
        self._ids = torch.empty(0, dtype=torch.int64, device=self.device)
        self._launchers = []
        self._staging: HostIdStaging | None = None
        self._stream = _current_stream_getter() if self.device.type == "cuda" else None
        if self.backend == "triton" and self._allocations:
            kernel = _kernel_module()
            programs = kernel.max_programs(self.device)
            self._launchers = [
                kernel.ZeroLauncher(a.base, a.tables, num_blocks, a.vec_bytes // 4, programs)
                for a in self._allocations
            ]
            if self.device.type == "cuda":
                self._staging = HostIdStaging(self.device, os.environ.get(STAGING_ENV) or "copy")

    def _pick_backend(self, backend: str) -> str:
        if backend == "torch" or not self._allocations:
            return "torch" if backend == "torch" else "triton"
        runnable = self.device.type == "cuda" or (self.device.type == "cpu" and _interpreting())
        if _kernel_module() is None:
            runnable = False
        if backend == "triton" and not runnable:
            raise ValueError(
                f"the Triton zeroing kernel cannot run on {self.device} here; install triton, "
                "set TRITON_INTERPRET=1 before importing triton to run it on CPU, or pass backend='torch'"
            )
        return "triton" if runnable else "torch"

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

        Ints, lists, tuples and CPU integer tensors are checked on the host:
        integers in ``[0, num_blocks)`` (bools, floats and bool tensors are
        refused), else ``ValueError`` and nothing written. On CUDA, up to 64
        ids are passed by value in the launch, more are staged through a
        persistent pinned ring: no allocation, no device sync.
        An integer tensor on the zeroer's CUDA device is used as is (no host
        sync, graph-capturable); the kernel skips ids out of range, and
        ``validate=True`` checks them on the host first (one sync).
        """
        if type(block_ids) is list and self._staging is not None:
            # NOTE: the hot path: a scheduler's list of new blocks.
            ids = id_list(block_ids, self.num_blocks)
            if ids:
                self._launch_host(ids)
            return
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            ids = device_ids(block_ids, self.device, self.num_blocks, validate)
            if ids.numel():
                self._launch(ids)
            return
        ids = host_ids(block_ids, self.num_blocks)
        if len(ids) == 0:
            return
        if self._staging is not None:
            self._launch_host(ids)
            return
        tensor = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)
        self._launch(tensor.to(self.device))

    def _launch_host(self, ids: list[int] | torch.Tensor) -> None:
        """Stage checked host ids into the pinned ring and launch on them."""
        staging = self._staging
        if len(ids) > staging.max_ids:
            tensor = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)
            self._launch(tensor.pin_memory().to(self.device, non_blocking=True))
            return
        stream = self._stream(self.device.index)
        launchers = self._launchers
        if len(ids) <= LISTED and type(ids) is list:
            # NOTE: a short list travels in the launch's parameters: no ring, no copy.
            staging.refuse_capture()
            launchers = [launcher for launcher in launchers if not launcher.launch_list(ids, stream)]
            if not launchers:
                return
        offset = staging.stage(ids, stream)
        for launcher in launchers:
            launcher.launch(staging.buffer, offset, len(ids), stream)

    def _launch(self, ids: torch.Tensor) -> None:
        if self.backend == "torch":
            keep = ids[(ids >= 0) & (ids < self.num_blocks)]
            for alloc in self._allocations:
                for seg in alloc.segments:
                    rows = alloc.bytes.as_strided((self.num_blocks, seg.page), (seg.block_stride, 1), seg.offset)
                    rows.index_fill_(0, keep, 0)
            return
        stream = self._stream(self.device.index) if self._stream is not None else None
        for launcher in self._launchers:
            launcher.launch(ids, 0, ids.numel(), stream)

    def warmup(self, num_kv_blocks: int) -> None:
        """Compile the kernel; zero block 0 only when ``num_kv_blocks > 0``."""
        num_kv_blocks = non_negative_int("num_kv_blocks", num_kv_blocks)
        if num_kv_blocks > 0:
            self.zero_block_ids([0])
        elif self.backend == "triton" and self._allocations:
            # An empty id list: the launch compiles the kernel and stores nothing.
            kernel = _kernel_module()
            empty = self.block_id_buffer(1)[:0]
            for alloc in self._allocations:
                kernel.launch_table(alloc.base, empty, self.num_blocks, alloc.tables[0], alloc.vec_bytes // 4, 1)


def _checked_view(name: Any, entry: Any, num_blocks: int) -> tuple[torch.Tensor, int]:
    """One ``(view, rows_per_block)`` entry of :meth:`KVBlockZeroer.from_views`, checked."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
        raise TypeError(
            f"views[{name!r}] must be a (tensor view, rows_per_block) tuple, got {type(entry).__name__}"
        )
    view, rows = entry
    rows = positive_int(f"rows_per_block of layer {name!r}", rows)
    if view.dim() < 2:
        raise ValueError(
            f"layer {name!r}: a {view.dim()}-D tensor is no layer view [blocks, ...]; pass the views "
            "allocate_kv_cache makes (raw buffers of specs without layer views cannot be zeroed by block)"
        )
    if view.shape[0] != num_blocks * rows:
        raise ValueError(
            f"layer {name!r} has {view.shape[0]} rows, not num_blocks * rows_per_block = "
            f"{num_blocks} * {rows}; pass the views as allocated with their split ratio"
        )
    return view, rows
