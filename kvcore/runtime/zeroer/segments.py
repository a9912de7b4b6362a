"""The segment table: where every manager block of every layer lives.

A *segment* is one contiguous byte run that repeats once per manager block:
block ``b`` owns bytes ``[offset + b * block_stride, ... + page)`` of one
allocation. A layer view yields one segment per combination of the dims that
are not part of its innermost contiguous run and per kernel block of a split
manager block (:func:`kvcore.memory.runs.block_runs`). Segments of one stride
that touch or overlap merge (overlaid groups keep the widest page), so no byte
is zeroed twice. The table does not depend on how many blocks are in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import torch

from kvcore.memory.runs import block_runs

#: Refuse views that would explode into more segments than this (per allocation).
MAX_SEGMENTS = 1 << 20


@attrs.frozen(order=True)
class Segment:
    """Bytes ``[offset + b * block_stride, offset + b * block_stride + page)`` of block ``b``."""

    block_stride: int
    offset: int
    page: int


def layer_segments(view: torch.Tensor, ratio: int = 1) -> list[Segment]:
    """Segments of one layer view ``[B * ratio, ...]`` (``ratio`` rows per manager block), offsets in its storage."""
    el = view.element_size()
    byte_strides = [s * el for s in view.stride()]
    offsets, run = block_runs(view.shape, byte_strides, el, ratio, max_runs=MAX_SEGMENTS)
    start = view.data_ptr() - view.untyped_storage().data_ptr()
    return [Segment(byte_strides[0] * ratio, start + o, run) for o in offsets]


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


def allocation_segments(
    views: Mapping[str, tuple[torch.Tensor, int]], num_blocks: int, what: str
) -> list[tuple[torch.UntypedStorage, list[Segment]]]:
    """Per allocation under ``views`` (layer -> ``(view, rows per block)``), its merged, checked segments.

    ``ValueError`` unless every run is 4-byte aligned and ``num_blocks`` blocks lie inside the allocation.
    """
    per_storage: dict[int, tuple[torch.UntypedStorage, list[Segment]]] = {}
    for view, rows in views.values():
        storage = view.untyped_storage()
        per_storage.setdefault(storage.data_ptr(), (storage, []))[1].extend(layer_segments(view, rows))
    out = []
    for storage, found in per_storage.values():
        segments = merge_segments(found)
        for seg in segments:
            if seg.offset % 4 or seg.block_stride % 4 or seg.page % 4:
                raise ValueError(
                    f"{what}: a block run at byte {seg.offset} with block stride {seg.block_stride} and "
                    f"{seg.page} bytes is not a multiple of 4 bytes; the zeroer stores 4-byte words, so pad "
                    "pages and state sizes to 4 bytes"
                )
            end = seg.offset + (num_blocks - 1) * seg.block_stride + seg.page
            if seg.offset < 0 or end > storage.nbytes():
                raise ValueError(
                    f"{what}: block {num_blocks - 1} would end at byte {end}, beyond the {storage.nbytes()}-byte "
                    "allocation; pass the num_blocks the caches were planned for"
                )
        out.append((storage, segments))
    return out


def vector_bytes(segments: list[Segment], base_address: int) -> int:
    """Widest store (16, 8 or 4 bytes) that divides the base and every offset, stride and page."""
    values = [base_address] + [v for s in segments for v in (s.offset, s.block_stride, s.page)]
    return next(width for width in (16, 8, 4) if all(v % width == 0 for v in values))


def chunk_table(segments: list[Segment], chunk_bytes: int, vec_bytes: int, device: torch.device) -> torch.Tensor:
    """The kernel's int64 ``[3, chunks]`` table: every run cut into pieces of at most ``chunk_bytes``.

    Rows: chunk start, block stride, chunk length, in vectors of ``vec_bytes``.
    """
    chunks = [(s.offset + begin, s.block_stride, min(chunk_bytes, s.page - begin))
              for s in segments for begin in range(0, s.page, chunk_bytes)]
    columns = [[c[k] // vec_bytes for c in chunks] for k in range(3)]
    return torch.tensor(columns, dtype=torch.int64, device=device).reshape(3, len(chunks))
