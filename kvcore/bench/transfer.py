"""``kvcore bench transfer``: host offload / restore and NIXL transfers against copy ceilings.

For each layout, moves random, never adjacent blocks of a model's KV cache:
``HostKVPool.offload`` / ``restore`` against one pinned ``copy_(non_blocking=True)`` of as
many bytes, measured in the same run (CUDA events, median of repeats; wall times on CPU);
and, where NIXL imports, NIXL writes and reads to a peer agent
(:mod:`kvcore.bench.transfer_nixl`). Without CUDA the defaults are CPU-sized.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import textwrap
from typing import Any

import torch

from kvcore.bench.options import CPU_TRANSFER_DEFAULTS as CPU_DEFAULTS
from kvcore.bench.options import GPU_TRANSFER_DEFAULTS as GPU_DEFAULTS
from kvcore.bench.options import ARGUMENTS
from kvcore.bench._timing import Timer
from kvcore._table import Column, render, terminal_width
from kvcore._units import format_bytes
from kvcore.bench.transfer_descs import descriptor_rows_of, print_descriptor_rows
from kvcore.bench.transfer_nixl import gbps, nixl_rows, print_rows, rate
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.registry import get_plugin_manager
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import FullAttentionSpec
from kvcore.transfer import HostKVPool, NixlUnavailableError, plan_transfer

add_arguments = ARGUMENTS["transfer"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _LayoutOnlyBackend(AttentionBackend):
    """Takes any block size and layout; the benchmark never runs attention."""

    name = "bench-transfer"

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the transfer benchmark does not run attention")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with the options left unset taken from the GPU or the CPU defaults."""
    args = argparse.Namespace(**vars(args))
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    defaults = GPU_DEFAULTS if args.device.type == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.nixl_peer is None:
        args.nixl_peer = "process" if args.device.type == "cuda" else "local"
    return args


def model_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")}


def build_cache(model: dict[str, Any], layout: str, num_blocks: int, device: str) -> KVCache:
    """The benchmark's cache (a module function, so a spawned NIXL peer can build it too)."""
    spec = FullAttentionSpec(model["block_size"], model["kv_heads"], model["head_size"],
                             _DTYPES[model["dtype"]])
    specs = {f"layers.{i}.attn": spec for i in range(model["layers"])}
    return KVCache.create(
        specs, dict.fromkeys(specs, _LayoutOnlyBackend), device=device, layout=layout,
        num_blocks=num_blocks, max_num_seqs=1, max_model_len=model["block_size"],
        plugin_manager=get_plugin_manager(autoload=False),
    )


def _host_rows(args, layout, device, timer, gen, tick) -> list[dict[str, Any]]:
    most = max(args.blocks)
    kv = build_cache(model_of(args), layout.name, 2 * most + 1, str(device))
    pool = HostKVPool(kv, most)
    device_buf = torch.empty(pool.host.numel(), dtype=torch.int8, device=device)
    rows = []
    for n in args.blocks:
        # NOTE: odd ids only, so no two blocks are neighbours: runs per block is the layout's.
        ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
        slots = torch.randperm(most, generator=gen)[:n].tolist()
        regions = plan_transfer(pool.descriptor, ids)
        nbytes = sum(r.length for r in regions)
        host, dev = pool.host[:nbytes], device_buf[:nbytes]
        row = {"layout": layout.name, "blocks": n, "bytes": nbytes, "block_bytes": nbytes // n,
               "runs": len(regions), "runs_per_block": len(regions) / n,
               "copies": pool.offload(ids, slots).num_runs}
        row["offload_us"] = timer.gpu_us(lambda: pool.offload(ids, slots, non_blocking=True))
        row["restore_us"] = timer.gpu_us(lambda: pool.restore(slots, ids, non_blocking=True))
        row["d2h_memcpy_us"] = timer.gpu_us(lambda: host.copy_(dev, non_blocking=True))
        row["h2d_memcpy_us"] = timer.gpu_us(lambda: dev.copy_(host, non_blocking=True))
        for key in ("offload", "restore", "d2h_memcpy", "h2d_memcpy"):
            row[f"{key}_gbps"] = gbps(nbytes, row[f"{key}_us"])
        row["offload_vs_memcpy"] = row["d2h_memcpy_us"] / row["offload_us"]
        row["restore_vs_memcpy"] = row["h2d_memcpy_us"] / row["restore_us"]
        rows.append(row)
        tick()
    del kv, pool, device_buf
    return rows


def collect(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Measure every layout: what ``--json`` prints. ``progress(total)`` returns a tick."""
    args = resolve(args)
    device = args.device
    cuda = device.type == "cuda"
    memories = args.nixl_memory or (["VRAM", "VRAM-DRAM", "DRAM"] if cuda else ["DRAM"])
    gpu_kinds = [m for m in memories if "VRAM" in m]
    if gpu_kinds and not cuda:
        raise ValueError(f"--nixl-memory {','.join(gpu_kinds)} needs a CUDA --device, got "
                         f"{device}; use --nixl-memory DRAM")
    steps = (0 if args.no_host else len(args.blocks)) + (
        0 if args.no_nixl else len(memories) * len(args.nixl_blocks)
    )
    tick = progress(steps * len(args.layouts)) if progress is not None else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "model": model_of(args), "nixl_peer": args.nixl_peer,
        "nixl_progress_thread": args.nixl_progress_thread,
        "host": [], "nixl": [], "nixl_skipped": None, "nixl_failed": {},
    }
    if not args.no_host:
        timer = Timer(device, args.repeats, args.warmup)
        for layout in args.layouts:
            result["host"] += _host_rows(args, layout, device, timer, gen, tick)
            torch.cuda.empty_cache()
        del timer
    if args.no_nixl:
        result["nixl_skipped"] = "--no-nixl"
        return result
    for memory in memories:
        try:
            for layout in args.layouts:
                make = functools.partial(build_cache, model_of(args), layout.name)
                result["nixl"] += nixl_rows(args, make, memory, device, gen, args.nixl_peer, tick)
                torch.cuda.empty_cache()
        except NixlUnavailableError as exc:
            result["nixl_skipped"] = str(exc)
            break
        except Exception as exc:  # NOTE: NIXL/UCX raise their own types; the other rows report
            result["nixl_failed"][memory] = f"{type(exc).__name__}: {exc}"
    return result


def _print(result: dict[str, Any]) -> None:
    width = terminal_width()
    m = result["model"]
    title = (f"KV block offload / restore on {result['device']}: {m['layers']} layers, "
             f"{m['kv_heads']} KV heads of {m['head_size']}, {m['block_size']}-token blocks, "
             f"{m['dtype']}")
    columns = [Column("layout"), Column("blocks", right=True), Column("block", right=True),
               Column("runs/blk", right=True), Column("copies", right=True),
               Column("offload GB/s", right=True), Column("x memcpy", right=True),
               Column("restore GB/s", right=True), Column("x memcpy", right=True)]
    if result["host"]:
        print(render(columns, [[
            r["layout"], r["blocks"], format_bytes(r["block_bytes"]), f"{r['runs_per_block']:.0f}",
            r["copies"], rate(r["offload_gbps"]), f"{r['offload_vs_memcpy']:.3f}",
            rate(r["restore_gbps"]), f"{r['restore_vs_memcpy']:.3f}",
        ] for r in result["host"]], title=title, width=width))
        first = result["host"][0]
        print(textwrap.fill(
            "x memcpy: one pinned copy_(non_blocking=True) of the same bytes, device to host for "
            "offload and host to device for restore, measured in the same run "
            f"({first['d2h_memcpy_gbps']:.1f} / {first['h2d_memcpy_gbps']:.1f} GB/s in the first "
            "row).", width))
        print()
    if result["nixl_skipped"]:
        print(textwrap.fill(f"NIXL rows skipped: {result['nixl_skipped']}", width))
    if result["nixl"]:
        print_rows(result["nixl"], width)
    for memory, error in result["nixl_failed"].items():
        print(textwrap.fill(f"NIXL in {memory} failed: {error}", width))


def _quiet_nixl() -> None:
    """Keep NIXL's and UCX's INFO lines out of the report (a user's own setting wins)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    logging.getLogger("nixl").setLevel(logging.WARNING)


@contextlib.contextmanager
def _progress_bar():
    """A ``progress(total) -> tick`` drawing a rich bar on stderr (none where rich is missing)."""
    try:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
    except ImportError:  # NOTE: a bare GPU machine may run kvcore from PYTHONPATH, without rich
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        def progress(total: int):
            task = bar.add_task("kvcore bench transfer", total=total)
            return lambda: bar.advance(task)

        yield progress


def run(args: argparse.Namespace) -> int:
    _quiet_nixl()
    if args.descriptors:
        args = resolve(args)
        model = {**model_of(args), "head_size": 1}
        result = descriptor_rows_of(args, lambda layout, n: build_cache(model, layout, n, "cpu"))
    else:
        with _progress_bar() as progress:
            result = collect(args, progress)
    text = json.dumps(result, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    elif args.descriptors:
        print_descriptor_rows(result, model, terminal_width())
    else:
        _print(result)
    return 0
