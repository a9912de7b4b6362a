"""``kvcore bench zero``: block zeroer vs a per-layer loop, zero_() and memset (GPU).

For each layout and block count, zeroes random blocks of a model's KV cache
with the zeroer (one launch), a per-layer torch loop (``view[ids] = 0``), a
contiguous ``zero_()`` and ``cudaMemsetAsync`` of the same bytes (the write
ceiling). Device times: CUDA events after an L2 flush, medians (zeroer and
memset in alternation, one block with more repeats); host times: the zeroer's
call with a list of ids until it returns; wall times: the call and a sync.
"""

import argparse
import sys
import textwrap
from typing import Any

import torch

from kvcore._table import Column, render, terminal_width
from kvcore._units import format_bytes
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.runtime.zeroer import kernel as zero_kernel
from kvcore.runtime.zeroer import zeroer as zero_module
from kvcore.specs import FullAttentionSpec
from kvcore_bench import emit, fmt, table
from kvcore_bench._timing import Timer, empty_launch, find_memset
from kvcore_bench.options import ARGUMENTS

add_arguments = ARGUMENTS["zero"]


def _model(args: argparse.Namespace, layout: KVCacheLayout, device: torch.device):
    dtype = getattr(torch, args.dtype)
    spec = FullAttentionSpec(args.block_size, args.kv_heads, args.head_size, dtype)
    pool = args.pool_blocks or 2 * max(args.blocks)
    layers = [f"layers.{i}.attn" for i in range(args.layers)]
    kv = allocate_kv_cache(plan_kv_cache(dict.fromkeys(layers, spec), layout, num_blocks=pool),
                           device)
    zeroer = KVBlockZeroer.from_views(device, {name: (kv[name], 1) for name in layers}, pool)
    zeroer.warmup(1)
    raw = torch.empty(0, dtype=torch.uint8, device=device).set_(kv[layers[0]].untyped_storage())
    return pool, kv, zeroer, raw


def collect(args: argparse.Namespace, device: torch.device | str) -> dict[str, Any]:
    """Measure every (layout, block count); the result is what ``--json`` prints."""
    device = torch.device(device)
    timer = Timer(device, args.repeats, args.warmup)
    memset = find_memset() if device.type == "cuda" else None
    empty = empty_launch(device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "model": {k: getattr(args, k)
                  for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")},
        "memset": memset[1] if memset else None,
        "empty_launch_us": timer.gpu_us(empty) if empty else None,
        "empty_launch_wall_us": timer.wall_us(empty) if empty else None,
        "rows": [],
    }
    gen = torch.Generator().manual_seed(0)
    for layout in args.layouts:
        pool, kv, zeroer, raw = _model(args, layout, device)
        views = list(kv.values())
        for n in args.blocks:
            ids_list = torch.randperm(pool, generator=gen)[:n].tolist()
            ids = torch.tensor(ids_list, device=device)
            nbytes = n * zeroer.bytes_per_block
            row: dict[str, Any] = {"layout": layout.name, "blocks": n, "bytes": nbytes}
            # NOTE: zeroer and memset in alternation; one block, where the two differ by tenths of a
            # microsecond, gets more repeats (--one-block-repeats).
            repeats = max(args.repeats, args.one_block_repeats) if n == 1 else args.repeats
            flat = raw[:nbytes]
            fns = [lambda: zeroer.zero_block_ids(ids), lambda: zeroer.zero_block_ids(ids_list)]
            if memset:
                fns.append(lambda: memset[0](flat.data_ptr(), nbytes))
            times = timer.gpu_group_us(fns, repeats) + [None]
            row["zeroer_us"], row["zeroer_list_us"], row["memset_us"] = times[:3]
            row["zeroer_host_us"] = timer.host_us(lambda: zeroer.zero_block_ids(ids_list))
            row["zeroer_wall_us"] = timer.wall_us(lambda: zeroer.zero_block_ids(ids_list))

            def loop(index: Any) -> None:
                for view in views:
                    view[index] = 0

            # NOTE: wall times take the ids as a Python list (as a scheduler hands them over).
            row["loop_us"] = timer.gpu_us(lambda: loop(ids))
            row["loop_wall_us"] = timer.wall_us(lambda: loop(ids_list))
            row["zero_us"] = timer.gpu_us(flat.zero_)
            result["rows"].append(_derive(row))
        kv = zeroer = raw = views = None  # NOTE: frees this layout's cache before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["targets"] = targets(result)
    return result


def _derive(row: dict[str, Any]) -> dict[str, Any]:
    for name in ("zeroer", "zero", "memset"):
        row[f"{name}_gbps"] = _ratio(row["bytes"] / 1e3, row[f"{name}_us"])
    row["speedup_vs_loop"] = row["loop_us"] / row["zeroer_us"]
    row["speedup_vs_loop_wall"] = row["loop_wall_us"] / row["zeroer_wall_us"]
    row["bw_vs_zero"] = row["zero_us"] / row["zeroer_us"]
    row["bw_vs_memset"] = _ratio(row["memset_us"], row["zeroer_us"])
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The H200 targets, each with the worst value of the rows it covers."""
    rows = result["rows"]
    small = [r for r in rows if r["blocks"] <= 64]
    large = [r for r in rows if r["blocks"] >= 512]
    single = [r for r in rows if r["blocks"] == 1]
    checks = [
        ("host time per call (us) at <= 64 blocks", small, "<=", 15.0,
         lambda r: r.get("zeroer_host_us")),
        ("speedup vs per-layer loop (wall) at <= 64 blocks", small, ">=", 100.0,
         lambda r: r["speedup_vs_loop_wall"]),
        ("speedup vs per-layer loop (device) at <= 64 blocks", small, ">=", 100.0,
         lambda r: r["speedup_vs_loop"]),
        ("bandwidth vs zero_() at >= 512 blocks", large, ">=", 1.1, lambda r: r["bw_vs_zero"]),
        ("bandwidth vs memset at >= 512 blocks", large, ">=", 0.93, lambda r: r["bw_vs_memset"]),
        ("one block (host list, as begin_step): time / memset time", single, "<=", 1.15,
         lambda r: _ratio(r["zeroer_list_us"], r["memset_us"])),
        ("one block (device ids): time / memset time", single, "<=", 1.15,
         lambda r: _ratio(r["zeroer_us"], r["memset_us"])),
        ("one block: time / empty launch time", single, "<=", 2.0,
         lambda r: _ratio(r["zeroer_us"], result["empty_launch_us"])),
    ]
    out = []
    for name, subset, op, bound, value in checks:
        values = [v for v in map(value, subset) if v is not None]
        worst = (min(values) if op == ">=" else max(values)) if values else None
        met = None if worst is None else (worst >= bound if op == ">=" else worst <= bound)
        out.append({"target": name, "bound": f"{op} {bound}", "worst": worst, "met": met})
    return out


def _print_table(result: dict[str, Any]) -> None:
    width = terminal_width()
    rows = result["rows"]
    head = [("layout", "layout", ""), ("blocks", "blocks", "d")]
    print(table(f"KV block zeroing on {result['device']}: time per call (empty Triton launch "
                f"{fmt(result['empty_launch_us'], '.2f')} us)", [
        *head, ("size", lambda r: format_bytes(r["bytes"]), "s"),
        ("zeroer us", "zeroer_us", ".2f"), ("host us", "zeroer_host_us", ".2f"),
        ("wall us", "zeroer_wall_us", ".2f"), ("loop us", "loop_us", ".1f"),
        ("x loop", "speedup_vs_loop", ".1f"), ("x loop wall", "speedup_vs_loop_wall", ".1f"),
    ], rows, width))
    print(textwrap.fill(
        "zeroer: device time of one launch on device ids (CUDA events); host: the zeroer call "
        "with a list of ids until it returns (no sync); wall: that call and a sync; loop: device "
        "time of view[ids] = 0 per layer; x loop: loop time / zeroer time (device; wall)", width))
    print()
    print(table("bandwidth (device time; list: the call with a host list of ids)", [
        *head, ("zeroer GB/s", "zeroer_gbps", ".0f"), ("zero_() GB/s", "zero_gbps", ".0f"),
        ("memset GB/s", "memset_gbps", ".0f"), ("x zero_() bw", "bw_vs_zero", ".2f"),
        ("x memset bw", "bw_vs_memset", ".2f"),
        ("list x memset", lambda r: _ratio(r["memset_us"], r["zeroer_list_us"]), ".2f"),
    ], rows, width))
    print()
    met = {True: "yes", False: "NO", None: "-"}
    print(render([Column("target", wrap=True), Column("bound"), Column("measured", right=True),
                  Column("met")],
                 [[t["target"], t["bound"], fmt(t["worst"], ".2f"), met[t["met"]]]
                  for t in result["targets"]], title="targets (worst row)", width=width))
    if result["memset"] is None:
        print("memset column skipped: no cudaMemsetAsync / cuMemsetD8Async found")


def run(args: argparse.Namespace) -> int:
    if args.pool_blocks is not None and args.pool_blocks < max(args.blocks):
        raise ValueError(
            f"--pool-blocks {args.pool_blocks} is fewer than the {max(args.blocks)} blocks "
            "--blocks zeroes in one call; allocate at least that many"
        )
    if not torch.cuda.is_available():
        print("kvcore bench zero: needs a CUDA GPU (none found); run it on a GPU machine",
              file=sys.stderr)
        return 2

    # NOTE: tuning knobs override the library's module defaults for this process only.
    if args.programs_per_sm:
        zero_kernel.PROGRAMS_PER_SM = args.programs_per_sm
    if args.chunk_kib:
        zero_module.CHUNK_BYTES = args.chunk_kib << 10
    result = collect(args, torch.device("cuda"))
    result["tuning"] = {"programs_per_sm": zero_kernel.PROGRAMS_PER_SM,
                        "chunk_bytes": zero_module.CHUNK_BYTES}
    emit(args, result, _print_table)
    return 0
