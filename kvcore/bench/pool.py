"""``kvcore bench pool``: host cost per block of the block pool, prefix caching off vs on.

One run times both pools on the same traffic: ``--requests`` requests of
``--blocks`` blocks each are allocated, zeroed (``take_new_blocks``) and freed.
The caching pool also runs what a prefix cache adds: recording the blocks
(``cache_blocks``), freeing them into the evictable list, hitting them again
(``get_cached_blocks``), allocating with every block evicted, and hashing the
tokens (``block_hashes``). Figures are nanoseconds per block, medians of
``--repeat`` rounds, on the CPU that runs the command.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

from kvcore.bench import emit
from kvcore.bench.options import POOL_MAX_BLOCKS
from kvcore.bench.options import ARGUMENTS
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.prefix_hash import block_hashes

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
    """One round of every operation; total ns per operation and pool."""
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

    ``progress`` is called after the traffic is made and after every round
    (``repeat + 2`` calls in all).
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
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"BlockPool, ns per block ({result['requests']} requests x "
                  f"{result['blocks_per_request']} blocks, this CPU)")
    for column in ("operation", "caching off", "caching on", "on / off"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        off = "-" if row["off_ns"] is None else f"{row['off_ns']:.0f}"
        ratio = "-" if row["on_over_off"] is None else f"{row['on_over_off']:.2f}x"
        table.add_row(row["label"], off, f"{row['on_ns']:.0f}", ratio)
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    # NOTE: progress goes to stderr (stdout stays the table or the JSON) and is erased when done.
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("traffic, warm-up and timed rounds", total=args.repeat + 2)
        rows = measure(args.requests, args.blocks, args.block_size, args.repeat,
                       progress=lambda: bar.advance(task))
    emit(args, {"requests": args.requests, "blocks_per_request": args.blocks,
                "block_size": args.block_size, "repeat": args.repeat, "rows": rows}, _print_table)
    return 0
