"""The NIXL side of kvcore's transfers: the import, descriptor arrays, transfer handles.

NIXL is optional (``pip install kvcore[nixl]``): imported only when an agent is made; a
missing install raises :class:`NixlUnavailableError`.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import torch

from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore.transfer.pairs import PairedRuns


class NixlUnavailableError(ImportError):
    """NIXL is not installed (or does not import)."""


class TransferError(RuntimeError):
    """NIXL reported a failed transfer."""


def nixl_api() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` from ``nixl``, else from one CUDA build of it.

    The ``nixl`` meta package picks its CUDA 12 or 13 build at import; where only one
    build (``nixl-cu12`` or ``nixl-cu13``) is installed, that build is imported directly.
    """
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
    if device.startswith("cuda"):
        return "VRAM", int(device.partition(":")[2] or 0)
    return "DRAM", 0


def xfer_arrays(
    plan: list[PairedRuns], local: KVCacheDescriptor, remote: KVCacheDescriptor, *,
    local_is_src: bool = True,
) -> tuple[Any, Any]:
    """NIXL's ``Nx3`` ``[address, length, device id]`` arrays of the local and remote runs."""
    sides: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for part in plan:
        ends = [(part.src_allocation, part.src_offsets), (part.dst_allocation, part.dst_offsets)]
        ends = ends if local_is_src else ends[::-1]
        for rows, desc, (index, offsets) in zip(sides, (local, remote), ends):
            alloc = desc.allocations[index]
            device = torch.full_like(part.lengths, mem_type(alloc.device)[1])
            rows.append(torch.stack([offsets + alloc.base_ptr, part.lengths, device], dim=1))
    np = importlib.import_module("numpy")  # NOTE: numpy comes with NIXL, so it is imported here
    return tuple(torch.cat(rows).numpy().astype(np.uint64) for rows in sides)


class TransferHandle:
    """One NIXL transfer in flight; :meth:`wait` returns when its bytes have moved."""

    def __init__(self, agent: Any, handle: Any, num_runs: int, nbytes: int,
                 transport: Any = None) -> None:
        self._agent, self._handle = agent, handle
        self.num_runs, self.nbytes = num_runs, nbytes
        #: How the bytes travel (:class:`kvcore.transfer.transport.Transport`), and NIXL's backend.
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
