"""KVBlockZeroer: clear newly allocated manager blocks in every layer, in one launch."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvcore._validate import non_negative_int, positive_int
from kvcore.runtime.attn_group import AttentionGroup, flatten_attention_groups
from kvcore.runtime.zeroer.ids import device_ids, host_ids
from kvcore.runtime.zeroer.segments import (
    Segment,
    check_segments,
    chunk_segments,
    layer_segments,
    merge_segments,
    vector_bytes,
)

#: Largest run one kernel work item zeroes.
CHUNK_BYTES = 32 * 1024
_BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _Allocation:
    """Device tables of one allocation's chunks (one kernel launch)."""

    def __init__(self, storage: torch.UntypedStorage, segments: list[Segment], device: torch.device) -> None:
        whole = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.bytes = whole
        self.base = whole[: storage.nbytes() // 4 * 4].view(torch.int32)
        self.segments = segments
        self.vec_bytes = vector_bytes(segments, storage.data_ptr())
        chunks = chunk_segments(segments, CHUNK_BYTES)
        width = self.vec_bytes

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.chunk_start = column([c.offset // width for c in chunks])
        self.chunk_stride = column([c.block_stride // width for c in chunks])
        self.chunk_len = column([c.page // width for c in chunks])


class KVBlockZeroer:
    """Zero listed manager blocks in every layer's cache with one kernel launch.

    Built once after the caches are allocated: each layer view of ``kv_caches``
    (layer name -> tensor) served by ``attn_groups`` (flat or one list per KV
    cache group) becomes segments (see :mod:`kvcore.runtime.zeroer.segments`), merged
    per allocation. Attention and state caches are zeroed; runner-only layers,
    layers without a tensor and specs without layer views are skipped. Runs,
    offsets and strides must be multiples of 4 bytes (``ValueError`` here).

    ``backend``: ``"triton"`` (the kernel; on CPU only under
    ``TRITON_INTERPRET=1``), ``"torch"`` (one indexed fill per segment, slow,
    for machines without Triton), or ``"auto"`` (Triton when it can run).
    """

    def __init__(
        self,
        device: torch.device | str,
        attn_groups: Iterable[Any],
        kernel_block_sizes: list[int],
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        runner_only_attn_layers: Iterable[str] | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_blocks = positive_int("num_blocks", num_blocks)
        if backend not in _BACKENDS:
            raise ValueError(f"Unsupported zeroer backend: {backend!r}. Supported: {list(_BACKENDS)}")
        skip = set(runner_only_attn_layers or ())
        per_storage: dict[int, tuple[torch.UntypedStorage, list[Segment]]] = {}
        for group in flatten_attention_groups(attn_groups):
            spec = group.kv_cache_spec
            if not spec.has_layer_views:
                continue
            ratio = self._ratio(group, kernel_block_sizes)
            for name in group.layer_names:
                view = kv_caches.get(name)
                if name in skip or not isinstance(view, torch.Tensor):
                    continue
                if view.device != self.device:
                    raise ValueError(
                        f"layer {name!r} lives on {view.device}, the zeroer on {self.device}; "
                        "build the zeroer on the caches' device"
                    )
                if group.kernel_block_stride:
                    # NOTE: packed kernel-block views: zero by manager block instead.
                    view = group.map_kv_cache_to_manager_blocks(view, self.num_blocks)
                rows = self._rows_per_block(name, view, ratio)
                storage = view.untyped_storage()
                entry = per_storage.setdefault(storage.data_ptr(), (storage, []))
                entry[1].extend(layer_segments(view, self.num_blocks, rows))
        self._allocations = []
        for storage, segments in per_storage.values():
            segments = merge_segments(segments)
            check_segments(segments, self.num_blocks, storage.nbytes(), "KVBlockZeroer")
            self._allocations.append(_Allocation(storage, segments, self.device))
        self.backend = self._pick_backend(backend)
        self._ids = torch.empty(0, dtype=torch.int64, device=self.device)

    @staticmethod
    def _ratio(group: AttentionGroup, kernel_block_sizes: list[int]) -> int:
        block_size = group.kv_cache_spec.block_size
        kernel = group.kernel_block_size
        if kernel is None and group.kv_cache_group_id < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group.kv_cache_group_id]
        kernel = block_size if kernel is None else positive_int("kernel block size", kernel)
        if block_size % kernel:
            raise ValueError(
                f"group {group.kv_cache_group_id}: block size {block_size} is not divisible by "
                f"kernel block size {kernel}; pass kernel_block_sizes that divide the block sizes"
            )
        return block_size // kernel

    def _rows_per_block(self, name: str, view: torch.Tensor, ratio: int) -> int:
        """View rows per manager block: ``ratio`` for a kernel-block view, else 1."""
        if ratio == 1 or view.shape[0] == self.num_blocks * ratio:
            return ratio
        if view.shape[0] == self.num_blocks:
            return 1
        raise ValueError(
            f"layer {name!r} has {view.shape[0]} rows, neither {self.num_blocks} manager "
            f"blocks nor {self.num_blocks * ratio} kernel blocks; pass the num_blocks and "
            "kernel_block_sizes the caches were allocated with"
        )

    def _pick_backend(self, backend: str) -> str:
        if backend == "torch" or not self._allocations:
            return "torch" if backend == "torch" else "triton"
        runnable = self.device.type == "cuda" or (self.device.type == "cpu" and _interpreting())
        try:
            from kvcore.runtime.zeroer import kernel  # noqa: F401
        except ImportError:
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
        integers in ``[0, num_blocks)``, else ``ValueError`` and nothing written.
        An integer tensor on the zeroer's CUDA device is used as is (no host
        sync, graph-capturable); the kernel skips ids out of range, and
        ``validate=True`` checks them on the host first (one sync).
        """
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            ids = device_ids(block_ids, self.device, self.num_blocks, validate)
        else:
            values = host_ids(block_ids, self.num_blocks)
            if values.numel() == 0:
                return
            if self.device.type == "cpu":
                ids = values
            else:
                ids = self.block_id_buffer(values.numel())[: values.numel()]
                ids.copy_(values.pin_memory(), non_blocking=True)
        if ids.numel() == 0:
            return
        self._launch(ids)

    def _launch(self, ids: torch.Tensor) -> None:
        if self.backend == "torch":
            keep = ids[(ids >= 0) & (ids < self.num_blocks)]
            for alloc in self._allocations:
                for seg in alloc.segments:
                    rows = alloc.bytes.as_strided((self.num_blocks, seg.page), (seg.block_stride, 1), seg.offset)
                    rows.index_fill_(0, keep, 0)
            return
        from kvcore.runtime.zeroer.kernel import launch_zero_blocks, max_programs

        programs = max_programs(self.device)
        for alloc in self._allocations:
            launch_zero_blocks(
                alloc.base, ids, self.num_blocks, alloc.chunk_start, alloc.chunk_stride,
                alloc.chunk_len, alloc.vec_bytes // 4, programs,
            )

    def warmup(self, num_kv_blocks: int) -> None:
        """Compile the kernel; zero block 0 only when ``num_kv_blocks > 0``."""
        num_kv_blocks = non_negative_int("num_kv_blocks", num_kv_blocks)
        if num_kv_blocks > 0:
            self.zero_block_ids([0])
        elif self.backend == "triton" and self._allocations:
            # An empty id list: the launch compiles the kernel and stores nothing.
            self._launch(self.block_id_buffer(1)[:0])
