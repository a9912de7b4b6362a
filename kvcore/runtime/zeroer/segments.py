"""The segment table: where every manager block of every layer lives, as merged byte runs repeated
per block, so no byte is zeroed twice (docs/zeroer.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import torch

from kvcore.memory.layout import block_runs

MAX_SEGMENTS = 1 << 20  # NOTE: views that would explode into more segments are refused


@attrs.frozen(order=True)
class Segment:
    """Bytes ``[offset + b * block_stride, offset + b * block_stride + page)`` of block ``b``."""

    block_stride: int
    offset: int
    page: int


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Union of ``segments``: runs of one block stride that touch or overlap merge."""
    merged: list[Segment] = []
    for seg in sorted(set(segments)):  # NOTE: by block stride, then offset
        last = merged[-1] if merged else None
        if last is not None and last.block_stride == seg.block_stride and seg.offset <= last.offset + last.page:
            merged[-1] = attrs.evolve(last, page=max(last.page, seg.offset + seg.page - last.offset))
        else:
            merged.append(seg)
    return merged


class Allocation:
    """One allocation's merged segments, as bytes, as int32 vectors and as the kernel's chunk tables: per chunk
    size an int64 ``[3, chunks]`` table (start, block stride, length, in ``vec_bytes`` vectors), runs cut in chunks."""

    def __init__(self, storage: torch.UntypedStorage, segments: list[Segment], device: torch.device,
                 chunk_sizes: tuple[int, ...]) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.base = self.bytes[: storage.nbytes() // 4 * 4].view(torch.int32)
        self.segments = segments
        values = [storage.data_ptr()] + [v for s in segments for v in (s.offset, s.block_stride, s.page)]
        self.vec_bytes = next(width for width in (16, 8, 4) if all(v % width == 0 for v in values))
        self.tables = []
        for size in chunk_sizes:
            chunks = [(s.offset + begin, s.block_stride, min(size, s.page - begin))
                      for s in segments for begin in range(0, s.page, size)]
            columns = [[c[k] // self.vec_bytes for c in chunks] for k in range(3)]
            self.tables.append(torch.tensor(columns, dtype=torch.int64, device=device).reshape(3, len(chunks)))


def allocations(views: Mapping[str, tuple[torch.Tensor, int]], num_blocks: int, device: torch.device,
                chunk_sizes: tuple[int, ...]) -> list[Allocation]:
    """The allocations under ``views`` (layer -> ``(view, rows per block)``); ``ValueError`` unless every run is
    4-byte aligned and ``num_blocks`` blocks fit the allocation."""
    found: dict[int, tuple[torch.UntypedStorage, list[Segment]]] = {}
    for name, (view, rows) in views.items():
        if view.device != device:
            raise ValueError(f"layer {name!r} lives on {view.device}, the zeroer on {device}; "
                             "build the zeroer on the caches' device")
        storage, size = view.untyped_storage(), view.element_size()
        strides = [s * size for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, size, rows, max_runs=MAX_SEGMENTS)
        start = view.data_ptr() - storage.data_ptr()
        found.setdefault(storage.data_ptr(), (storage, []))[1].extend(
            Segment(strides[0] * rows, start + o, run) for o in offsets)
    out = []
    for storage, segments in found.values():
        segments = merge_segments(segments)
        for seg in segments:
            if seg.offset % 4 or seg.block_stride % 4 or seg.page % 4:
                raise ValueError(
                    f"KVBlockZeroer: a block run at byte {seg.offset} with block stride {seg.block_stride} and "
                    f"{seg.page} bytes is not a multiple of 4 bytes; the zeroer stores 4-byte words, so pad "
                    "pages and state sizes to 4 bytes"
                )
            end = seg.offset + (num_blocks - 1) * seg.block_stride + seg.page
            if seg.offset < 0 or end > storage.nbytes():
                raise ValueError(f"KVBlockZeroer: block {num_blocks - 1} would end at byte {end}, beyond the "
                                 f"{storage.nbytes()}-byte allocation; pass the num_blocks the caches were planned for")
        out.append(Allocation(storage, segments, device, chunk_sizes))
    return out
