"""The segment table: where every manager block of every layer lives.

A *segment* is one contiguous byte run that repeats once per manager block:
block ``b`` owns bytes ``[offset + b * block_stride, ... + page)`` of one
allocation. A layer view yields one segment per combination of the dims that
are not part of its innermost contiguous run (separate head groups under
LHBNC, heads interleaved with other layers under BHLNC) and per kernel block
of a split manager block. Segments of one stride that touch or overlap merge
(overlaid groups keep the widest page; adjacent layers of a block-outermost
layout become one run), so the table never zeroes a byte twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

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


def layer_segments(view: torch.Tensor, num_blocks: int, ratio: int = 1) -> list[Segment]:
    """Segments of one layer view ``[B * ratio, ...]``, offsets relative to its storage.

    ``ratio`` consecutive rows of the view (kernel blocks) form one manager
    block. Every byte the view addresses for blocks ``< num_blocks`` is covered
    exactly once.
    """
    if view.dim() < 1 or view.shape[0] < num_blocks * ratio:
        raise ValueError(
            f"a view of shape {tuple(view.shape)} holds fewer than {num_blocks} blocks of "
            f"{ratio} kernel block(s); pass the views allocated for {num_blocks} blocks"
        )
    el = view.element_size()
    start = view.data_ptr() - view.untyped_storage().data_ptr()
    byte_strides = [s * el for s in view.stride()]
    offsets, run = block_runs(view.shape, byte_strides, el, ratio, max_runs=MAX_SEGMENTS)
    block_stride = byte_strides[0] * ratio
    return [Segment(block_stride, start + o, run) for o in offsets]


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Union of ``segments``: runs of one block stride that touch or overlap merge.

    Two runs of one stride cover, for every block, the union of their bytes;
    when they touch, that union is one run, whatever the block.
    """
    merged: list[Segment] = []
    for stride, group in itertools.groupby(sorted(set(segments)), key=lambda s: s.block_stride):
        current: Segment | None = None
        for seg in group:
            if current is not None and seg.offset <= current.offset + current.page:
                end = max(current.offset + current.page, seg.offset + seg.page)
                current = Segment(stride, current.offset, end - current.offset)
                continue
            if current is not None:
                merged.append(current)
            current = seg
        if current is not None:
            merged.append(current)
    return merged


def check_segments(segments: list[Segment], num_blocks: int, nbytes: int, what: str) -> None:
    """``ValueError`` unless every run is 4-byte aligned and inside ``nbytes``."""
    for seg in segments:
        if seg.offset % 4 or seg.block_stride % 4 or seg.page % 4:
            raise ValueError(
                f"{what}: a block run at byte {seg.offset} with block stride "
                f"{seg.block_stride} and {seg.page} bytes is not a multiple of 4 bytes; "
                "the zeroer stores 4-byte words, so pad pages and state sizes to 4 bytes"
            )
        end = seg.offset + (num_blocks - 1) * seg.block_stride + seg.page
        if seg.offset < 0 or end > nbytes:
            raise ValueError(
                f"{what}: block {num_blocks - 1} would end at byte {end}, beyond the "
                f"{nbytes}-byte allocation; pass the num_blocks the caches were planned for"
            )


def chunk_segments(segments: list[Segment], chunk_bytes: int) -> list[Segment]:
    """Split every run into pieces of at most ``chunk_bytes`` (work items of the kernel)."""
    chunks = []
    for seg in segments:
        for begin in range(0, seg.page, chunk_bytes):
            chunks.append(Segment(seg.block_stride, seg.offset + begin, min(chunk_bytes, seg.page - begin)))
    return chunks


def vector_bytes(segments: list[Segment], base_address: int) -> int:
    """Widest store (16, 8 or 4 bytes) that divides the base and every offset, stride and page."""
    for width in (16, 8, 4):
        values = [base_address] + [v for s in segments for v in (s.offset, s.block_stride, s.page)]
        if all(v % width == 0 for v in values):
            return width
    raise ValueError("segments are not 4-byte aligned; call check_segments first")
