"""The other side of ``kvcore bench transfer``'s NIXL rows: an agent in this process or in another.

``LocalPeer`` is a second :class:`~kvcore.transfer.NixlAgent` of this process
(UCX loopback: on one GPU ``cuda_copy`` carries the data, since ``cuda_ipc``
cannot reach an agent of the same process). ``ProcessPeer`` serves a cache in
a spawned process (metadata over a pipe), so that on one GPU UCX may use
``cuda_ipc`` between the two processes, as disaggregated serving does. The
peer allocates its cache (so its CUDA context exists) before its agent.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer import NixlAgent
from kvcore.transfer.host_pool import raw_allocation


def fill(kv: KVCache, seed: int) -> None:
    """Random bytes in the whole cache (so every block differs from every other)."""
    raw = raw_allocation(kv)
    gen = torch.Generator(device=raw.device).manual_seed(seed)
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8, device=raw.device))


class LocalPeer:
    """A second agent of this process serving ``kv``."""

    def __init__(self, name: str, kv: KVCache) -> None:
        self.kv, self.agent = kv, NixlAgent(name, kv)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def connect(self, metadata: bytes) -> None:
        self.agent.connect(metadata)

    def refill(self, seed: int) -> None:
        fill(self.kv, seed)

    def close(self) -> None:
        self.agent.close()


def _serve(conn: Any, make: Callable[[], KVCache], name: str) -> None:
    kv = make()
    fill(kv, 2)
    agent = NixlAgent(name, kv)
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    conn.send("ready")
    while True:
        request, arg = conn.recv()
        if request == "refill":
            fill(kv, arg)
            if kv.device.type == "cuda":
                torch.cuda.synchronize(kv.device)
            conn.send("done")
        else:
            break
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

    def refill(self, seed: int) -> None:
        self._conn.send(("refill", seed))
        self._recv("refill")

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
