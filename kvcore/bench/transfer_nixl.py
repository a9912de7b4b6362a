"""NIXL rows of ``kvcore bench transfer``: agent ``a`` writes and reads a peer's blocks.

The peer is a second agent of this process (``--nixl-peer local``: UCX
loopback) or an agent in a spawned process (``process``: on one GPU, UCX may
use ``cuda_ipc`` between the two). For each layout and memory kind (``DRAM``:
host caches; ``VRAM``: both caches on the one CUDA device), ``a`` writes
random (odd, never adjacent) blocks into the same ids of the peer's cache and
reads them back, timed from the call to the handle's ``wait()`` returning
(wall time, device synced). Beside them, in the same run, plain copies of the
same byte count: a host ``copy_`` for DRAM; for VRAM a device-to-device
``copy_`` and a pinned host-to-device ``copy_(non_blocking=True)``. Each row
checks the round trip bit for bit (the blocks read back into spare local
blocks equal the ones written) and names the transport the agent reports.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore._table import Column, render
from kvcore.bench._timing import Timer
from kvcore.bench.transfer_peer import LocalPeer, ProcessPeer, fill
from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer import NixlAgent, describe, plan_transfer

MEMORY_KINDS = ("DRAM", "VRAM")
PEER_KINDS = ("local", "process")
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``make(num_blocks, device) -> KVCache``, picklable (a ``functools.partial`` of a module function).
CacheFn = Callable[[int, str], KVCache]


def rate(value: float) -> str:
    """A bandwidth or ratio in at most 5 characters (3 significant digits where they fit)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def memory_kinds_arg(text: str) -> list[str]:
    """argparse type: comma-separated NIXL memory kinds (``DRAM``, ``VRAM``)."""
    kinds = [k.strip().upper() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in MEMORY_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"expected comma-separated DRAM / VRAM, got {text!r}")
    return list(dict.fromkeys(kinds))


def _gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def _random_bytes(size: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-128, 128, (size,), generator=gen, dtype=torch.int8, device=device)


def _same_blocks(kv: KVCache, ids: list[int], other: list[int]) -> bool:
    """Whether blocks ``ids`` and ``other`` of ``kv`` hold the same bytes (as integers: random bytes make NaNs)."""
    device = next(iter(kv.kv_caches.values())).device
    a, b = torch.tensor(ids, device=device), torch.tensor(other, device=device)
    return all(
        torch.equal(view.view(_INTS[view.element_size()]).index_select(0, a),
                    view.view(_INTS[view.element_size()]).index_select(0, b))
        for view in kv.kv_caches.values()
    )


def nixl_rows(args: argparse.Namespace, make: CacheFn, memory: str, device: torch.device,
              gen: torch.Generator, peer_kind: str, tick: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
    """One row per block count of ``args.nixl_blocks`` in ``memory``, the peer ``peer_kind``."""
    on = device if memory == "VRAM" else torch.device("cpu")
    timer = Timer(on, args.repeats, args.warmup)
    most = max(args.nixl_blocks)
    a = make(2 * most + 2, str(on))  # the cache first: its CUDA context exists before any agent
    start = time.perf_counter()
    tag = f"bench-{memory.lower()}-{a.layout.name.lower()}"
    peer = (ProcessPeer(f"{tag}-b", _Maker(make, 2 * most + 2, str(on))) if peer_kind == "process"
            else LocalPeer(f"{tag}-b", make(2 * most + 2, str(on))))
    agent = None
    try:
        agent = NixlAgent(f"{tag}-a", a)
        name = agent.connect(peer.metadata())
        peer.connect(agent.metadata())
        setup_s = time.perf_counter() - start  # agents registering their caches, and connecting
        transport = agent.transport(name)
        desc = describe(a)
        size = most * desc.groups[0].layers[0].block_bytes * len(desc.groups[0].layers)
        src, dst = _random_bytes(size, on, 3), _random_bytes(size, on, 4)
        pinned = torch.empty(size, dtype=torch.int8, pin_memory=True) if on.type == "cuda" else None
        rows = []
        for i, n in enumerate(args.nixl_blocks):
            fill(a, 10 + i)
            ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
            spare = [b + 1 for b in ids]
            regions = plan_transfer(desc, ids)
            nbytes = sum(r.length for r in regions)
            differed = not _same_blocks(a, ids, spare)
            handle = agent.write_blocks(name, ids, ids)
            handle.wait(timeout=120)
            agent.read_blocks(name, ids, spare).wait(timeout=120)
            row = {"memory": memory, "layout": a.layout.name, "peer": peer_kind, "blocks": n, "bytes": nbytes,
                   "runs": len(regions), "exact": differed and _same_blocks(a, ids, spare), "setup_s": setup_s,
                   "transport": transport.name, "transport_detail": transport.detail, "backend": handle.backend}
            row["nixl_write_us"] = timer.wall_us(lambda: agent.write_blocks(name, ids, ids).wait(timeout=120))
            row["nixl_read_us"] = timer.wall_us(lambda: agent.read_blocks(name, ids, ids).wait(timeout=120))
            s, d = src[:nbytes], dst[:nbytes]
            refs = {"copy": lambda: d.copy_(s)}
            if pinned is not None:
                host = pinned[:nbytes]
                refs["h2d_memcpy"] = lambda: d.copy_(host, non_blocking=True)
            for key, fn in refs.items():
                row[f"{key}_us"] = timer.wall_us(fn)
            for key in ("nixl_write", "nixl_read", *refs):
                row[f"{key}_gbps"] = _gbps(nbytes, row[f"{key}_us"])
            row["write_vs_copy"] = row["copy_us"] / row["nixl_write_us"]
            rows.append(row)
            tick()
        return rows
    finally:
        if agent is not None:
            agent.close()
        peer.close()


class _Maker:
    """``make(num_blocks, device)`` bound to its arguments, for the spawned peer (picklable)."""

    def __init__(self, make: CacheFn, num_blocks: int, device: str) -> None:
        self.make, self.num_blocks, self.device = make, num_blocks, device

    def __call__(self) -> KVCache:
        return self.make(self.num_blocks, self.device)


def print_rows(rows: list[dict[str, Any]], width: int) -> None:
    """The NIXL table of ``kvcore bench transfer`` (fits ``width`` columns)."""
    columns = [Column("mem"), Column("layout"), Column("peer"), Column("blocks", right=True),
               Column("runs", right=True), Column("exact"), Column("transport"),
               Column("write GB/s", right=True), Column("read GB/s", right=True),
               Column("copy_ GB/s", right=True), Column("x copy_", right=True)]
    print(render(columns, [[
        r["memory"], r["layout"], r["peer"], r["blocks"], r["runs"], "yes" if r["exact"] else "NO",
        r["transport"], rate(r["nixl_write_gbps"]), rate(r["nixl_read_gbps"]), rate(r["copy_gbps"]),
        rate(r["write_vs_copy"]),
    ] for r in rows], title="NIXL: agent a writes / reads the peer's blocks (wall time to wait())", width=width))
    memcpy = [r for r in rows if "h2d_memcpy_gbps" in r]
    notes = []
    if memcpy:
        notes.append("pinned host-to-device memcpy of the same bytes, GB/s: "
                     + ", ".join(f"{r['layout']} {r['blocks']}: {r['h2d_memcpy_gbps']:.1f}" for r in memcpy) + ".")
    notes.append("copy_: host copy_ (DRAM) or device-to-device copy_ (VRAM) of the same bytes; transport: "
                 "inferred by NixlAgent.transport() (see kvcore.transfer.transport).")
    for note in notes:
        print(textwrap.fill(note, width))
