"""Staged host copies: gather a block's many runs on the device, then move one contiguous slot.

When a layout stores a block as many equal runs (one per layer in LBNHC, per
layer and head in LHBNC), issuing one host copy per run is bound by the host.
Instead, one ``index_select`` on the device packs the listed blocks' runs in
host-slot order into a staging buffer (or ``index_copy_`` unpacks it), and the
host copies move whole slots, merged where slots are consecutive.
"""

from __future__ import annotations

import attrs
import torch

from kvcore.transfer.pairs import PairedRuns, merge_pairs
from kvcore.transfer.plan import BlockPattern


@attrs.frozen
class StagedPlan:
    """Rows (of ``run_bytes`` each) of the device allocation in slot order, and the slot copies."""

    run_bytes: int
    rows: torch.Tensor = attrs.field(eq=False, repr=False)
    copies: PairedRuns  # src: staging buffer offsets, dst: host mirror offsets

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.run_bytes


def staged_plan(
    patterns: tuple[BlockPattern, ...], device_ids: torch.Tensor, host_ids: torch.Tensor, slot_bytes: int
) -> StagedPlan | None:
    """A staged plan when every block is several equal, aligned runs of one pattern; else None."""
    if len(patterns) != 1:
        return None
    p = patterns[0]
    run = p.lengths[0]
    if len(p.lengths) < 2 or any(n != run for n in p.lengths):
        return None
    if p.block_stride % run or any(s % run for s in p.starts):
        return None
    starts = torch.tensor(p.starts, dtype=torch.int64) // run
    rows = (device_ids[:, None] * (p.block_stride // run) + starts[None, :]).reshape(-1)
    block = p.block_bytes
    staging = torch.arange(device_ids.numel(), dtype=torch.int64) * block
    copies = PairedRuns(0, 0, *merge_pairs(staging, host_ids * slot_bytes, torch.full_like(staging, block)))
    return StagedPlan(run, rows, copies)


def run_table(buffer: torch.Tensor, run_bytes: int) -> torch.Tensor:
    """``buffer`` (flat int8) viewed as rows of ``run_bytes`` (a tail shorter than a row is left out)."""
    return buffer[: buffer.numel() // run_bytes * run_bytes].view(-1, run_bytes)
