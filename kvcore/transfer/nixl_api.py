"""The NIXL side of kvcore's transfers: the import (only when an agent is made), descriptor
arrays and prepared lists, transfer handles."""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.pairs import PairedRuns, merge_pairs


class NixlUnavailableError(ImportError):
    """NIXL is not installed (or does not import)."""


class TransferError(RuntimeError):
    """NIXL reported a failed transfer."""


def nixl_api() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from ``nixl``, else from its one CUDA build installed
    (``nixl-cu12`` or ``nixl-cu13``; the ``nixl`` meta package picks one at import)."""
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(module)
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise NixlUnavailableError(
        "NixlAgent needs NIXL, which does not import here (" + "; ".join(errors) + "); "
        "install it with `pip install kvcore[nixl]`"
    )


def mem_type(device: str) -> tuple[str, int]:
    """NIXL's memory kind and device id of a descriptor's allocation device."""
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    return "DRAM", 0


def xfer_arrays(plan: list[PairedRuns], src: KVCacheDescriptor, dst: KVCacheDescriptor) -> tuple[Any, Any]:
    """NIXL's ``Nx3`` ``[address, length, device id]`` arrays of the source and destination runs."""
    sides: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for part in plan:
        ends = [(part.src_allocation, part.src_offsets), (part.dst_allocation, part.dst_offsets)]
        for rows, desc, (index, offsets) in zip(sides, (src, dst), ends):
            alloc = desc.allocations[index]
            device = torch.full_like(part.lengths, mem_type(alloc.device)[1])
            rows.append(torch.stack([offsets + alloc.base_ptr, part.lengths, device], dim=1))
    return tuple(torch.cat(rows).numpy().astype("uint64") for rows in sides)


class TransferHandle:
    """One NIXL transfer in flight; :meth:`wait` returns when its bytes have moved."""

    def __init__(self, agent: Any, handle: Any, num_runs: int, nbytes: int, transport: Any = None) -> None:
        self._agent, self._handle = agent, handle
        self.num_runs, self.nbytes = num_runs, nbytes
        #: How the bytes travel (:class:`kvcore.transfer.transport.Transport`), and NIXL's backend.
        self.transport, self.backend = transport, None

    def done(self) -> bool:
        if self._handle is None:
            return True
        state = self._agent.check_xfer_state(self._handle)
        if state in ("ERR", "DONE"):
            self._agent.release_xfer_handle(self._handle)
            self._handle = None
        if state == "ERR":
            raise TransferError("NIXL reported an error for this transfer; the peer process may "
                                "have exited: reconnect to a live peer and move the blocks again")
        return state == "DONE"

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer not done after {timeout} s")
            time.sleep(0)


class PreparedRuns:
    """One side's whole-block runs as a NIXL prepared list: row ``r`` of NIXL's Nx5 strided
    rows ``(address, length, device, stride, count)`` is run ``r`` of the block patterns at
    every block, so descriptor ``r * num_blocks + b`` is that run in block ``b`` (``num_blocks``:
    the descriptor's unless given)."""

    def __init__(self, descriptor: KVCacheDescriptor, patterns, num_blocks: int | None = None) -> None:
        self.kind, self.device = mem_type(descriptor.allocations[patterns[0].allocation].device)
        bases = [descriptor.allocations[p.allocation].base_ptr for p in patterns]
        self.starts = torch.tensor([b + s for b, p in zip(bases, patterns) for s in p.starts])
        self.strides = torch.tensor([p.block_stride for p in patterns for _ in p.starts])
        self.lengths = torch.tensor([n for p in patterns for n in p.lengths])
        self.num_blocks = descriptor.num_blocks if num_blocks is None else num_blocks
        self.handle, self._agent = None, None

    def rows(self) -> Any:
        """NIXL's Nx5 strided rows, one per run (a uint64 numpy array)."""
        ones = torch.ones_like(self.starts)
        rows = [self.starts, self.lengths, ones * self.device, self.strides, ones * self.num_blocks]
        return torch.stack(rows, dim=1).numpy().astype("uint64")

    def prepare(self, agent: Any, owner: str) -> PreparedRuns:
        """Hand the rows to ``agent`` as ``owner``'s prepared list (``NIXL_INIT_AGENT``: local)."""
        self.handle, self._agent = agent.prep_xfer_dlist(owner, self.rows(), self.kind), agent
        return self

    def indices(self, ids: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Descriptor indices of every run of blocks ``ids`` (run-major, an int32 numpy array for
        NIXL), and their addresses."""
        rows = torch.arange(self.starts.numel())[:, None]
        index = (rows * self.num_blocks + ids[None, :]).flatten().to(torch.int32).numpy()
        return index, (self.starts[:, None] + self.strides[:, None] * ids).flatten()

    def release(self) -> None:
        if self.handle is not None:
            self._agent.release_dlist_handle(self.handle)
            self.handle = None


def paired_indices(local: PreparedRuns, far: PreparedRuns, loc: torch.Tensor,
                   rem: torch.Tensor) -> tuple[Any, Any, int, int]:
    """Indices moving local blocks ``loc`` onto the peer's ``rem`` (pairwise), the copies they
    make once NIXL merges those adjacent on both sides, and their bytes."""
    order = torch.argsort(loc)  # NOTE: blocks adjacent on both sides become one copy in NIXL
    local_index, local_addresses = local.indices(loc[order])
    remote_index, remote_addresses = far.indices(rem[order])
    lengths = local.lengths.repeat_interleave(loc.numel())
    copies = merge_pairs(local_addresses, remote_addresses, lengths)[0].numel()
    return local_index, remote_index, copies, int(lengths.sum())
