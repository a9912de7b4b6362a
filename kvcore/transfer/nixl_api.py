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
