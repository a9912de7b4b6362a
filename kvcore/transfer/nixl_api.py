"""The NIXL side of kvcore's transfers: import, descriptor rows, transfer handles.

NIXL is optional (``pip install kvcore[nixl]``): it is imported only when an
agent is made, and a missing install raises :class:`NixlUnavailableError`.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch


class NixlUnavailableError(ImportError):
    """NIXL is not installed (or does not import)."""


class TransferError(RuntimeError):
    """NIXL reported a failed transfer."""


def nixl_api() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from ``nixl``, else a single CUDA build of it.

    The ``nixl`` meta package picks its CUDA 12 or 13 build at import; where only one
    build is installed (``nixl-cu12`` or ``nixl-cu13``) that build is imported directly.
    """
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            # NOTE: NIXL is an optional dependency, imported only when an agent is made.
            api = importlib.import_module(module)
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise NixlUnavailableError(
        "NixlAgent needs NIXL, which does not import here (" + "; ".join(errors) + "); "
        "install it with `pip install kvcore[nixl]`"
    )


def mem_type(device: str) -> tuple[str, int]:
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    return "DRAM", 0


class TransferHandle:
    """One NIXL transfer in flight; :meth:`wait` returns when its bytes have moved."""

    def __init__(self, agent: Any, handle: Any, num_runs: int, nbytes: int, transport: Any = None) -> None:
        self._agent, self._handle = agent, handle
        self.num_runs, self.nbytes = num_runs, nbytes
        #: How the bytes travel (:class:`kvcore.transfer.transport.Transport`), and NIXL's backend name.
        self.transport, self.backend = transport, None

    def done(self) -> bool:
        if self._handle is None:
            return True
        state = self._agent.check_xfer_state(self._handle)
        if state == "ERR":
            self._release()
            raise TransferError(
                "NIXL reported an error for this transfer; the peer process may have exited: "
                "reconnect to a live peer and move the blocks again"
            )
        if state == "DONE":
            self._release()
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer not done after {timeout} s")
            time.sleep(0)

    def _release(self) -> None:
        if self._handle is not None:
            self._agent.release_xfer_handle(self._handle)
            self._handle = None


def descriptor_rows(base: int, offsets, lengths, device_id: int):
    """``[address, length, device id]`` rows (int64, CPU) of one allocation's runs."""
    return torch.stack([offsets + base, lengths, torch.full_like(lengths, device_id)], dim=1)


def xfer_array(rows):
    """NIXL's Nx3 descriptor array (numpy comes with NIXL, so it is imported only here)."""
    np = importlib.import_module("numpy")
    return torch.cat(rows).numpy().astype(np.uint64)


class PreparedRuns:
    """One side's whole-block runs as a NIXL prepared descriptor list, prepared once.

    Row ``r`` of the Nx5 strided list ``(address, length, device, stride, count)`` is run ``r`` of
    the block patterns at every block; descriptor ``r * num_blocks + b`` is that run in block ``b``.
    A transfer then names descriptors by index (``make_prepped_xfer``): no per-call descriptor lists.
    """

    def __init__(self, agent: Any, owner: str, descriptor: Any, patterns: Any) -> None:
        np = importlib.import_module("numpy")
        kind, device = mem_type(descriptor.allocations[patterns[0].allocation].device)
        self.starts = np.array([descriptor.allocations[p.allocation].base_ptr + s for p in patterns for s in p.starts],
                               dtype=np.int64)
        self.strides = np.array([p.block_stride for p in patterns for _ in p.starts], dtype=np.int64)
        self.lengths = np.array([n for p in patterns for n in p.lengths], dtype=np.int64)
        self.num_blocks = descriptor.num_blocks
        rows = np.stack([self.starts, self.lengths, np.full_like(self.starts, device), self.strides,
                         np.full_like(self.starts, self.num_blocks)], axis=1).astype(np.uint64)
        self._agent = agent
        self.handle = agent.prep_xfer_dlist(owner, rows, kind)

    def indices(self, ids: Any) -> Any:
        """Descriptor indices of every run of blocks ``ids`` (run-major), and their addresses."""
        np = importlib.import_module("numpy")
        rows = np.arange(len(self.starts), dtype=np.int64)[:, None]
        index = (rows * self.num_blocks + ids[None, :]).ravel()
        return index.astype(np.int32), (self.starts[:, None] + self.strides[:, None] * ids[None, :]).ravel()

    def release(self) -> None:
        self._agent.release_dlist_handle(self.handle)


def contiguous_runs(local_addresses: Any, remote_addresses: Any, lengths: Any) -> int:
    """How many copies the paired descriptors make once those adjacent on both sides merge."""
    if not len(lengths):
        return 0
    ends = lengths[:-1]
    breaks = (local_addresses[1:] != local_addresses[:-1] + ends) | (
        remote_addresses[1:] != remote_addresses[:-1] + ends
    )
    return 1 + int(breaks.sum())
