"""Staged host copies: gather blocks on the device in host-slot order, then move large copies.

A host copy per run (per block in a block-outermost layout, per layer and
block in a layer-compact one) is bound by the copy engine's per-copy cost.
Instead the listed blocks are put in host-slot order, and for each chunk of
them one ``index_select`` on the device packs their runs into a staging
buffer (``index_copy_`` unpacks it on restore). The host copies then move
whole slots, merged where slots are consecutive: one large copy per chunk
when the host ids are. On CUDA the gather of chunk ``k + 1`` runs on the
caller's stream while the copy of chunk ``k`` runs on a copy stream (events
order them), so the gather hides behind the PCIe copy; a ring of
``RING_BUFFERS`` chunk buffers bounds the device memory a call takes.
"""

from __future__ import annotations

import attrs
import torch

from kvcore.transfer.pairs import PairedRuns, merge_pairs
from kvcore.transfer.plan import BlockPattern

#: Bytes gathered per chunk: large copies, and enough chunks to overlap gather and copy.
CHUNK_BYTES = 32 << 20
#: Device staging buffers in flight: at most this many chunks of device memory per call.
RING_BUFFERS = 3


@attrs.frozen
class StagedChunk:
    """Table rows (``run_bytes`` each) of a chunk of blocks, and its copies (src: chunk buffer offsets)."""

    rows: torch.Tensor = attrs.field(eq=False, repr=False)
    copies: PairedRuns
    nbytes: int


@attrs.frozen
class StagedPlan:
    """The chunks of one staged offload or restore."""

    run_bytes: int
    chunks: tuple[StagedChunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def num_copies(self) -> int:
        return sum(c.copies.num_runs for c in self.chunks)


def staged_plan(
    patterns: tuple[BlockPattern, ...], device_ids: torch.Tensor, host_ids: torch.Tensor, slot_bytes: int,
    chunk_bytes: int | None = None,
) -> StagedPlan | None:
    """A staged plan when every block is equal, aligned runs of one pattern; else None."""
    if len(patterns) != 1 or not device_ids.numel():
        return None
    p = patterns[0]
    run = p.lengths[0]
    if any(n != run for n in p.lengths) or p.block_stride % run or any(s % run for s in p.starts):
        return None
    order = torch.argsort(host_ids, stable=True)  # host-slot order: consecutive slots merge into one copy
    device_ids, host_ids = device_ids[order], host_ids[order]
    starts = torch.tensor(p.starts, dtype=torch.int64) // run
    rows = (device_ids[:, None] * (p.block_stride // run) + starts[None, :])
    block = p.block_bytes
    per_chunk = max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // block)
    chunks = []
    for first in range(0, device_ids.numel(), per_chunk):
        hosts = host_ids[first : first + per_chunk]
        staging = torch.arange(hosts.numel(), dtype=torch.int64) * block
        copies = PairedRuns(0, 0, *merge_pairs(staging, hosts * slot_bytes, torch.full_like(staging, block)))
        chunks.append(StagedChunk(rows[first : first + per_chunk].reshape(-1), copies, hosts.numel() * block))
    return StagedPlan(run, tuple(chunks))


def run_table(buffer: torch.Tensor, run_bytes: int) -> torch.Tensor:
    """``buffer`` (flat int8) viewed as rows of ``run_bytes``, in the widest integer that divides a row."""
    table = buffer[: buffer.numel() // run_bytes * run_bytes].view(-1, run_bytes)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if run_bytes % size == 0 and buffer.data_ptr() % size == 0:
            return table.view(dtype)
    return table
