"""NIXL rows of ``kvcore bench transfer``: two agents of one process, loopback.

For each layout and memory kind (``DRAM``: host caches; ``VRAM``: both caches
on the one CUDA device), agent ``a`` writes random (odd, never adjacent)
blocks into the same ids of agent ``b``'s cache and reads them back, timed
from the call to the handle's ``wait()`` returning (wall time, device synced).
Beside them, in the same run, plain copies of the same byte count: a host
``copy_`` for DRAM; for VRAM a device-to-device ``copy_`` and a pinned
device-to-host ``copy_(non_blocking=True)`` (the host tier's memcpy ceiling).
Every row checks that the written blocks arrived bit for bit.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcore.bench._timing import Timer
from kvcore.memory.layout import KVCacheLayout
from kvcore.runtime.kv_cache import KVCache
from kvcore.transfer import NixlAgent, describe, plan_transfer
from kvcore.transfer.host_pool import raw_allocation

MEMORY_KINDS = ("DRAM", "VRAM")
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CacheFn = Callable[[KVCacheLayout, int, torch.device], KVCache]


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


def _fill(kv: KVCache, seed: int) -> None:
    raw = raw_allocation(kv)
    raw.copy_(_random_bytes(raw.numel(), raw.device, seed))


def _same_blocks(a: KVCache, b: KVCache, ids: list[int]) -> bool:
    """Whether blocks ``ids`` hold the same bytes in both caches (as integers: random bytes make NaNs)."""
    index = torch.tensor(ids, device=next(iter(a.kv_caches.values())).device)
    return all(
        torch.equal(view.view(_INTS[view.element_size()]).index_select(0, index),
                    b.kv_caches[name].view(_INTS[view.element_size()]).index_select(0, index))
        for name, view in a.kv_caches.items()
    )


def nixl_rows(args: argparse.Namespace, cache: CacheFn, layout: KVCacheLayout, memory: str,
              device: torch.device, gen: torch.Generator) -> list[dict[str, Any]]:
    """One row per block count of ``args.nixl_blocks`` for ``layout`` in ``memory``."""
    on = device if memory == "VRAM" else torch.device("cpu")
    timer = Timer(on, args.repeats, args.warmup)
    most = max(args.nixl_blocks)
    a, b = cache(layout, 2 * most + 1, on), cache(layout, 2 * most + 1, on)
    _fill(a, 1)
    start = time.perf_counter()
    agent_a = NixlAgent(f"bench-{memory.lower()}-a", a)
    agent_b = NixlAgent(f"bench-{memory.lower()}-b", b)
    try:
        peer = agent_a.connect(agent_b.metadata())
        agent_b.connect(agent_a.metadata())
        setup_s = time.perf_counter() - start  # two agents registering their caches, and connecting
        desc = describe(a)
        size = raw_allocation(a).numel() // 2  # NOTE: at most `most` of the 2 * most + 1 blocks move
        src, dst = _random_bytes(size, on, 3), _random_bytes(size, on, 4)
        pinned = torch.empty(size, dtype=torch.int8, pin_memory=True) if on.type == "cuda" else None
        rows = []
        for i, n in enumerate(args.nixl_blocks):
            _fill(b, 2 + i)  # fresh bytes, so every listed block differs from a's before the write
            ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
            regions = plan_transfer(desc, ids)
            nbytes = sum(r.length for r in regions)
            differed = not _same_blocks(a, b, ids)
            agent_a.write_blocks(peer, ids, ids).wait(timeout=120)
            row = {"memory": memory, "layout": layout.name, "blocks": n, "bytes": nbytes, "runs": len(regions),
                   "exact": differed and _same_blocks(a, b, ids), "setup_s": setup_s}
            row["nixl_write_us"] = timer.wall_us(lambda: agent_a.write_blocks(peer, ids, ids).wait(timeout=120))
            row["nixl_read_us"] = timer.wall_us(lambda: agent_a.read_blocks(peer, ids, ids).wait(timeout=120))
            s, d = src[:nbytes], dst[:nbytes]
            refs = {"copy": lambda: d.copy_(s)}
            if pinned is not None:
                host = pinned[:nbytes]
                refs["d2h_memcpy"] = lambda: host.copy_(s, non_blocking=True)
            for key, fn in refs.items():
                row[f"{key}_us"] = timer.wall_us(fn)
            for key in ("nixl_write", "nixl_read", *refs):
                row[f"{key}_gbps"] = _gbps(nbytes, row[f"{key}_us"])
            row["write_vs_copy"] = row["copy_us"] / row["nixl_write_us"]
            rows.append(row)
        return rows
    finally:
        agent_a.close()
        agent_b.close()


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The NIXL table of ``kvcore bench transfer``."""
    print("NIXL loopback, two agents of one process (UCX; wall time to wait(); copies of the same bytes)")
    head = ("memory", "layout", "blocks", "runs", "exact", "write GB/s", "read GB/s", "copy_ GB/s",
            "x copy_", "d2h memcpy")
    print("  ".join(f"{h:>10}" for h in head))
    for r in rows:
        memcpy = f"{r['d2h_memcpy_gbps']:.1f}" if "d2h_memcpy_gbps" in r else "-"
        cells = (r["memory"], r["layout"], r["blocks"], r["runs"], r["exact"], f"{r['nixl_write_gbps']:.2f}",
                 f"{r['nixl_read_gbps']:.2f}", f"{r['copy_gbps']:.2f}", f"{r['write_vs_copy']:.3g}", memcpy)
        print("  ".join(f"{c!s:>10}" for c in cells))
    print("copy_: host copy_ for DRAM, device-to-device copy_ for VRAM; d2h memcpy: pinned, non_blocking")
