"""NIXL rows of ``kvcore bench transfer``: agent ``a`` writes and reads a peer's blocks.

The peer is a second agent of this process (``--nixl-peer local``) or of a
spawned one (``process``). Per layout and memory kind (``DRAM``, ``VRAM``, or
``VRAM-DRAM``: the peer's cache on the host), ``a`` writes random, never
adjacent blocks into the same ids of the peer and reads them back (wall time
to ``wait()``), beside plain copies of as many bytes in the same run. Each row
checks the round trip bit for bit and names the agent's transport. Each side
allocates its cache before its agent, so its CUDA context exists when UCX
starts.
"""

import argparse
import functools
import multiprocessing
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer import NixlAgent, plan_transfer
from kvcore.transfer.descriptor import raw_allocation
from kvcore.transfer.nixl_api import nixl_api
from kvcore_bench import table
from kvcore_bench._timing import Timer

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``make(num_blocks, device) -> KVCache``, picklable (a partial of a module function).
CacheFn = Callable[[int, str], KVCache]


def rate(value: float) -> str:
    """A bandwidth or ratio in at most 5 characters (3 significant digits where they fit)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def _random_bytes(size: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-128, 128, (size,), generator=gen, dtype=torch.int8, device=device)


def _fill(kv: KVCache, seed: int) -> None:
    """Random bytes in the whole cache (so every block differs from every other)."""
    raw = raw_allocation(kv)
    raw.copy_(_random_bytes(raw.numel(), raw.device, seed))


def _serve(conn: Any, make: Callable[[], KVCache], name: str) -> None:
    """The spawned peer: an agent serving ``make()``'s cache until told to stop."""
    kv = make()
    _fill(kv, 2)
    agent = NixlAgent(name, kv)
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    conn.send("ready")
    conn.recv()
    agent.close()
    conn.send("closed")


class ProcessPeer:
    """An agent in a spawned process (metadata over a pipe): UCX may use ``cuda_ipc``."""

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


def _same_blocks(kv: KVCache, ids: list[int], other: list[int]) -> bool:
    """Whether blocks ``ids`` and ``other`` hold the same bits (random bytes hold NaNs)."""
    a, b = torch.tensor(ids, device=kv.device), torch.tensor(other, device=kv.device)
    views = [view.view(_INTS[view.element_size()]) for view in kv.kv_caches.values()]
    return all(torch.equal(view.index_select(0, a), view.index_select(0, b)) for view in views)


def _references(row: dict[str, Any], nbytes: int, src, dst, pinned, timer: Timer) -> None:
    """Plain copies of the same bytes, and the NIXL write / read against the matching one."""
    s, d = src[:nbytes], dst[:nbytes]
    refs = {"copy": lambda: d.copy_(s)}
    if pinned is not None:
        host = pinned[:nbytes]
        refs["h2d_memcpy"] = lambda: d.copy_(host, non_blocking=True)
        refs["d2h_memcpy"] = lambda: host.copy_(s, non_blocking=True)
    for key, fn in refs.items():
        row[f"{key}_us"] = timer.wall_us(fn)
    for key in ("nixl_write", "nixl_read", *refs):
        row[f"{key}_gbps"] = gbps(nbytes, row[f"{key}_us"])
    # a write moves local -> peer, a read peer -> local: VRAM-DRAM compares with d2h / h2d memcpy
    to_host = row["memory"] == "VRAM-DRAM"
    write_ref, read_ref = ("d2h_memcpy", "h2d_memcpy") if to_host else ("copy", "copy")
    row["write_ref"], row["read_ref"] = write_ref, read_ref
    row["write_vs_ref"] = row[f"{write_ref}_us"] / row["nixl_write_us"]
    row["read_vs_ref"] = row[f"{read_ref}_us"] / row["nixl_read_us"]


def nixl_rows(args: argparse.Namespace, make: CacheFn, memory: str, device: torch.device,
              gen: torch.Generator, peer_kind: str, tick: Callable[[], None] = lambda: None
              ) -> list[dict[str, Any]]:
    """One row per block count of ``args.nixl_blocks`` in ``memory``, the peer ``peer_kind``."""
    cpu = torch.device("cpu")
    on, peer_on = {"VRAM": (device, device), "VRAM-DRAM": (device, cpu)}.get(memory, (cpu, cpu))
    timer = Timer(on, args.repeats, args.warmup)
    # NOTE: a plain copy is quick and noisy: on a CPU it is repeated more (as the host rows' are).
    cpu_ref = on.type == "cpu"
    reference = Timer(on, max(args.repeats, 20) if cpu_ref else args.repeats,
                      max(args.warmup, 3) if cpu_ref else args.warmup)
    most = max(args.nixl_blocks)
    a = make(2 * most + 2, str(on))  # the cache first: its CUDA context exists before any agent
    start = time.perf_counter()
    tag = f"bench-{memory.lower()}-{a.layout.name.lower()}"
    progress = getattr(args, "nixl_progress_thread", True)
    # NOTE: the peer keeps NIXL's progress thread (it only serves: nothing else would progress it).
    # A local peer is a second agent of this process (UCX loopback; cuda_copy on one GPU).
    make_peer = functools.partial(make, 2 * most + 2, str(peer_on))
    if peer_kind == "process":
        nixl_api()  # NOTE: NixlUnavailableError here, not a peer that never answers
        peer = ProcessPeer(f"{tag}-b", make_peer)
    else:
        peer = NixlAgent(f"{tag}-b", make_peer())
    agent = None
    try:
        agent = NixlAgent(f"{tag}-a", a, progress_thread=progress)
        name = agent.connect(peer.metadata())
        peer.connect(agent.metadata())
        setup_s = time.perf_counter() - start  # agents registering their caches, and connecting
        transport = agent.transport(name)
        desc = agent.descriptor
        size = most * desc.groups[0].layers[0].block_bytes * len(desc.groups[0].layers)
        src, dst = _random_bytes(size, on, 3), _random_bytes(size, on, 4)
        pinned = torch.empty(size, dtype=torch.int8, pin_memory=True) if on.type == "cuda" else None
        rows = []
        for i, n in enumerate(args.nixl_blocks):
            _fill(a, 10 + i)
            ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
            spare = [b + 1 for b in ids]
            regions = plan_transfer(desc, ids)
            nbytes = sum(r.length for r in regions)
            differed = not _same_blocks(a, ids, spare)
            handle = agent.write_blocks(name, ids, ids)
            handle.wait(timeout=120)
            agent.read_blocks(name, ids, spare).wait(timeout=120)
            row = {"memory": memory, "layout": a.layout.name, "peer": peer_kind, "blocks": n,
                   "bytes": nbytes, "runs": len(regions), "setup_s": setup_s,
                   "exact": differed and _same_blocks(a, ids, spare), "transport": transport.name,
                   "transport_detail": transport.detail, "backend": handle.backend,
                   "progress_thread": progress}
            write = functools.partial(agent.write_blocks, name, ids, ids)
            read = functools.partial(agent.read_blocks, name, ids, ids)
            row["nixl_write_us"] = timer.wall_us(lambda: write().wait(timeout=120))
            row["nixl_read_us"] = timer.wall_us(lambda: read().wait(timeout=120))
            _references(row, nbytes, src, dst, pinned, reference)
            rows.append(row)
            tick()
        return rows
    finally:
        if agent is not None:
            agent.close()
        peer.close()


_REF_NAMES = {"copy": "copy_", "d2h_memcpy": "d2h memcpy", "h2d_memcpy": "h2d memcpy"}


def print_rows(rows: list[dict[str, Any]], width: int) -> None:
    """The NIXL table of ``kvcore bench transfer`` (fits ``width`` columns)."""
    peers = " and ".join(sorted({r["peer"] for r in rows}))
    print(table(f"NIXL: agent a writes / reads blocks of a peer in {peers} (wall time to wait())", [
        ("memory", "memory", ""), ("layout", "layout", ""), ("blocks", "blocks", "d"),
        ("runs", "runs", "d"), ("exact", lambda r: "yes" if r["exact"] else "NO", ""),
        ("transport", "transport", ""),
        ("write GB/s", lambda r: rate(r["nixl_write_gbps"]), "s"),
        ("x ref", "write_vs_ref", ".3f"),
        ("read GB/s", lambda r: rate(r["nixl_read_gbps"]), "s"),
        ("x ref", "read_vs_ref", ".3f"),
    ], rows, width))
    refs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        for key in (r["write_ref"], r["read_ref"]):
            refs.setdefault((r["memory"], key), []).append(r[f"{key}_gbps"])
    speeds = "; ".join(f"{mem} {_REF_NAMES[key]} {', '.join(rate(v) for v in values)}"
                       for (mem, key), values in refs.items())
    print(textwrap.fill("x ref: the time of a plain copy of the same bytes over the NIXL time: "
                        "device-to-device (VRAM) or host (DRAM) copy_; for VRAM-DRAM a pinned d2h "
                        f"memcpy (write) and h2d memcpy (read). Reference GB/s: {speeds}.", width))
    print(textwrap.fill("transport: inferred by NixlAgent.transport() (see "
                        "kvcore.transfer.transport).", width))
