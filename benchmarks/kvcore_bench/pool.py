"""``kvcore bench pool``: host cost per block of the block pool, prefix caching off vs on.

Both pools serve the same traffic: ``--requests`` requests of ``--blocks``
blocks are allocated, zeroed (``take_new_blocks``) and freed; the caching pool
also caches, frees to the evictable list, hits, allocates evicting and hashes
the tokens. Nanoseconds per block, medians of ``--repeat`` rounds, on this
CPU.
"""

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.prefix_hash import block_hashes
from kvcore_bench import emit, machine, progress_bar, table
from kvcore_bench.options import ARGUMENTS, POOL_MAX_BLOCKS

add_arguments = ARGUMENTS["pool"]

_ROWS = (
    ("allocate", "allocate (plain free blocks)"),
    ("take_new", "take_new_blocks"),
    ("free", "free (to plain)"),
    ("cache", "cache_blocks"),
    ("free_evictable", "free (cached: to evictable)"),
    ("hit", "get_cached_blocks (hit)"),
    ("allocate_evict", "allocate (evicting)"),
    ("hash", "block_hashes"),
)


def _time(fn: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def _round(off: BlockPool, on: BlockPool, hashes: list[list[bytes]], tokens: list[list[int]],
           block_size: int, n: int) -> dict[str, dict[str, int]]:  # fmt: skip
    """Total ns per operation and pool of one round."""
    k = len(hashes)
    out: dict[str, dict[str, int]] = {"off": {}, "on": {}}
    for name, pool in (("off", off), ("on", on)):
        held: list[list[int]] = []
        out[name]["allocate"] = _time(lambda: [held.append(pool.allocate(n)) for _ in range(k)])
        out[name]["take_new"] = _time(pool.take_new_blocks)
        out[name]["free"] = _time(lambda: [pool.free(ids) for ids in held])
    t = out["on"]
    held = [on.allocate(n) for _ in range(k)]
    on.take_new_blocks()
    t["cache"] = _time(lambda: [on.cache_blocks(h, ids) for h, ids in zip(hashes, held)])
    t["free_evictable"] = _time(lambda: [on.free(ids[::-1]) for ids in held])
    hits: list[list[int]] = []
    t["hit"] = _time(lambda: [hits.append(on.get_cached_blocks(h)) for h in hashes])
    if sum(map(len, hits)) != k * n:
        raise RuntimeError(f"the cached prefixes hit {sum(map(len, hits))} of {k * n} blocks")
    for ids in hits:
        on.free(ids)
    evicted: list[list[int]] = []
    t["allocate_evict"] = _time(lambda: [evicted.append(on.allocate(n)) for _ in range(k)])
    on.take_new_blocks()
    for ids in evicted:
        on.free(ids)
    t["hash"] = _time(lambda: [block_hashes(tok, block_size) for tok in tokens])
    return out


def measure(num_requests: int, blocks_per_request: int, block_size: int, repeat: int,
            progress: Callable[[], object] | None = None) -> list[dict]:
    """Rows of ``{"op", "label", "off_ns", "on_ns", "on_over_off"}``, ns per block (medians).

    ``progress()`` is called after making the traffic and after every round, warm-up included.
    """
    k, n = num_requests, blocks_per_request
    if k * n > POOL_MAX_BLOCKS:
        raise ValueError(
            f"{k:,} requests x {n:,} blocks = {k * n:,} blocks per round, more than the "
            f"{POOL_MAX_BLOCKS:,} this benchmark takes (a larger round runs for minutes and "
            "measures the same ns per block); lower --requests or --blocks"
        )
    tick = progress or (lambda: None)
    rng = random.Random(0)
    tokens = [[rng.randrange(150_000) for _ in range(n * block_size)] for _ in range(k)]
    hashes = [block_hashes(tok, block_size) for tok in tokens]
    tick()
    off = BlockPool(k * n + 1)
    on = BlockPool(k * n + 1, enable_caching=True)
    samples: dict[tuple[str, str], list[float]] = {}
    enabled = gc.isenabled()
    gc.disable()
    try:
        _round(off, on, hashes, tokens, block_size, n)  # warm-up
        tick()
        for _ in range(max(1, repeat)):
            for name, ops in _round(off, on, hashes, tokens, block_size, n).items():
                for op, ns in ops.items():
                    samples.setdefault((name, op), []).append(ns / (k * n))
            tick()
    finally:
        if enabled:
            gc.enable()
    rows = []
    for op, label in _ROWS:
        off_ns = statistics.median(samples[("off", op)]) if ("off", op) in samples else None
        on_ns = statistics.median(samples[("on", op)])
        rows.append({"op": op, "label": label, "off_ns": off_ns, "on_ns": on_ns,
                     "on_over_off": on_ns / off_ns if off_ns else None})
    return rows


def _print_table(result: dict) -> None:
    print(table(f"BlockPool, ns per block ({result['requests']} requests x "
                f"{result['blocks_per_request']} blocks) on {result['machine']}", [
        ("operation", "label", ""), ("caching off", "off_ns", ".0f"),
        ("caching on", "on_ns", ".0f"),
        ("on / off",
         lambda r: "-" if r["on_over_off"] is None else f"{r['on_over_off']:.2f}x", "s"),
    ], result["rows"]))


def run(args: argparse.Namespace) -> int:
    with progress_bar("traffic, warm-up and timed rounds") as start:
        rows = measure(args.requests, args.blocks, args.block_size, args.repeat,
                       progress=start(args.repeat + 2))
    emit(args, {"machine": machine(torch.device("cpu")), "requests": args.requests, "blocks_per_request": args.blocks,
                "block_size": args.block_size, "repeat": args.repeat, "rows": rows}, _print_table)
    return 0
