"""The peer of ``kvcore bench transfer``'s NIXL rows: an agent in this process or another.

``LocalPeer`` is a second agent of this process (UCX loopback: on one GPU ``cuda_copy``
carries the data, ``cuda_ipc`` cannot reach the same process). ``ProcessPeer`` serves a
cache in a spawned process (metadata over a pipe), so that on one GPU UCX may use
``cuda_ipc``, as disaggregated serving does. Each allocates its cache before its agent.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer import NixlAgent
from kvcore.transfer.descriptor import raw_allocation


def random_bytes(size: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-128, 128, (size,), generator=gen, dtype=torch.int8, device=device)


def fill(kv: KVCache, seed: int) -> None:
    """Random bytes in the whole cache (so every block differs from every other)."""
    raw = raw_allocation(kv)
    raw.copy_(random_bytes(raw.numel(), raw.device, seed))


class LocalPeer:
    """A second agent of this process serving ``kv``."""

    def __init__(self, name: str, kv: KVCache) -> None:
        self.agent = NixlAgent(name, kv)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def connect(self, metadata: bytes) -> None:
        self.agent.connect(metadata)

    def close(self) -> None:
        self.agent.close()


def _serve(conn: Any, make: Callable[[], KVCache], name: str) -> None:
    kv = make()
    fill(kv, 2)
    agent = NixlAgent(name, kv)
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    conn.send("ready")
    conn.recv()  # until told to stop
    agent.close()
    conn.send("closed")


class ProcessPeer:
    """An agent in a spawned process serving the cache ``make()`` builds there."""

    def __init__(self, name: str, make: Callable[[], KVCache], timeout: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, there = ctx.Pipe()
        self._timeout = timeout
        self._proc = ctx.Process(target=_serve, args=(there, make, name), daemon=True)
        self._proc.start()
        self._metadata = self._recv("its metadata")

    def _recv(self, what: str) -> Any:
        if not self._conn.poll(self._timeout):
            self.close()
            raise TimeoutError(f"the peer process sent no {what} in {self._timeout:.0f} s")
        return self._conn.recv()

    def metadata(self) -> bytes:
        return self._metadata

    def connect(self, metadata: bytes) -> None:
        self._conn.send(metadata)
        self._recv("connection")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
                self._conn.poll(30) and self._conn.recv()
            except (OSError, EOFError):
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
