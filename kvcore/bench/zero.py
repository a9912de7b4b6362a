"""``kvcore bench zero``: the block zeroer against a per-layer loop, zero_() and memset (GPU).

For each layout and block count, zeroes random blocks of a model's KV cache
with: the zeroer (one launch), a per-layer torch loop (``view[ids] = 0``), a
contiguous ``zero_()`` of the same byte count, and ``cudaMemsetAsync`` of the
same bytes (the write ceiling). Device times come from CUDA events after an
L2 flush (median of repeats); wall times include the host call and a sync.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kvcore.runtime.attn_group import AttentionGroup
from kvcore.plugins.backend import AttentionBackend
from kvcore.bench._timing import Timer, empty_launch, find_memset
from kvcore.cli._args import layouts_arg
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.specs import FullAttentionSpec
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _BenchBackend(AttentionBackend):
    name = "bench"


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=_int_list, default=[1, 8, 64, 512, 4096], help="block counts (1,8,...)")
    parser.add_argument("--layouts", type=layouts_arg, default=layouts_arg("LBNHC,BLNHC,LHBNC"), help="layouts")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--pool-blocks", type=int, default=None, help="blocks allocated (default 2x the most zeroed)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON to PATH")
    tune = parser.add_argument_group("kernel tuning (defaults are the library's)")
    tune.add_argument("--programs-per-sm", type=int, default=None, help="grid cap: programs per SM")
    tune.add_argument("--chunk-kib", type=int, default=None, help="largest work item, KiB")


def _model(args: argparse.Namespace, layout: KVCacheLayout, device: torch.device):
    spec = FullAttentionSpec(args.block_size, args.kv_heads, args.head_size, _DTYPES[args.dtype])
    pool = args.pool_blocks or 2 * max(args.blocks)
    layers = [f"layers.{i}.attn" for i in range(args.layers)]
    strides = compute_layout_strides(spec, pool, len(layers), layout)
    tensor = KVCacheTensor(pool * len(layers) * spec.page_size_bytes, layers, strides[0], strides[1])
    config = KVCacheConfig(pool, [tensor], [KVCacheGroupSpec(layers, spec)], layout)
    kv = allocate_kv_cache(config, device)
    group = AttentionGroup(_BenchBackend, layers, spec, 0)
    zeroer = KVBlockZeroer(device, [group], [spec.block_size], kv, pool)
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
        "model": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")},
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
            row["zeroer_us"] = timer.gpu_us(lambda: zeroer.zero_block_ids(ids))
            row["zeroer_wall_us"] = timer.wall_us(lambda: zeroer.zero_block_ids(ids_list))

            def loop(index: Any) -> None:
                for view in views:
                    view[index] = 0

            # NOTE: wall times take the ids as a Python list (as a scheduler hands them over).
            row["loop_us"] = timer.gpu_us(lambda: loop(ids))
            row["loop_wall_us"] = timer.wall_us(lambda: loop(ids_list))
            flat = raw[:nbytes]
            row["zero_us"] = timer.gpu_us(flat.zero_)
            row["memset_us"] = timer.gpu_us(lambda: memset[0](flat.data_ptr(), nbytes)) if memset else None
            result["rows"].append(_derive(row))
        del kv, zeroer, raw, views
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["targets"] = targets(result)
    return result


def _derive(row: dict[str, Any]) -> dict[str, Any]:
    """Add GB/s and the ratios of one row."""
    def gbps(us: float | None) -> float | None:
        return None if not us else row["bytes"] / us / 1e3

    for name in ("zeroer", "zero", "memset"):
        row[f"{name}_gbps"] = gbps(row[f"{name}_us"])
    row["speedup_vs_loop"] = row["loop_us"] / row["zeroer_us"]
    row["speedup_vs_loop_wall"] = row["loop_wall_us"] / row["zeroer_wall_us"]
    row["bw_vs_zero"] = row["zero_us"] / row["zeroer_us"]
    row["bw_vs_memset"] = row["memset_us"] / row["zeroer_us"] if row["memset_us"] else None
    return row


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The H200 targets, each with the worst measured value over the rows it covers."""
    rows = result["rows"]
    small = [r for r in rows if r["blocks"] <= 64]
    large = [r for r in rows if r["blocks"] >= 512]
    single = [r for r in rows if r["blocks"] == 1]
    checks = [
        ("speedup vs per-layer loop (wall) at <= 64 blocks", small, "speedup_vs_loop_wall", ">=", 100.0),
        ("speedup vs per-layer loop (device) at <= 64 blocks", small, "speedup_vs_loop", ">=", 100.0),
        ("bandwidth vs zero_() at >= 512 blocks", large, "bw_vs_zero", ">=", 1.1),
        ("bandwidth vs memset at >= 512 blocks", large, "bw_vs_memset", ">=", 0.93),
        ("one block: time / memset time", single, "memset_us", "<=", 1.15),
        ("one block: time / empty launch time", single, "empty", "<=", 2.0),
    ]
    out = []
    for name, subset, key, op, bound in checks:
        values = []
        for r in subset:
            if key == "empty":
                values.append(r["zeroer_us"] / result["empty_launch_us"] if result["empty_launch_us"] else None)
            elif key == "memset_us":
                values.append(r["zeroer_us"] / r["memset_us"] if r["memset_us"] else None)
            else:
                values.append(r[key])
        values = [v for v in values if v is not None]
        worst = (min(values) if op == ">=" else max(values)) if values else None
        met = None if worst is None else (worst >= bound if op == ">=" else worst <= bound)
        out.append({"target": name, "bound": f"{op} {bound}", "worst": worst, "met": met})
    return out


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v: float | None, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    console = Console()
    empty = result["empty_launch_us"]
    title = f"KV block zeroing on {result['device']} (empty Triton launch {fmt(empty, '.2f')} us)"
    table = Table(title=title)
    for col in ("layout", "blocks", "MiB", "zeroer us", "GB/s", "loop us", "x loop", "x loop wall",
                "zero_() GB/s", "memset GB/s", "x zero_() bw", "x memset bw"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(
            r["layout"], str(r["blocks"]), fmt(r["bytes"] / 2**20), fmt(r["zeroer_us"], ".2f"),
            fmt(r["zeroer_gbps"], ".0f"), fmt(r["loop_us"]), fmt(r["speedup_vs_loop"]),
            fmt(r["speedup_vs_loop_wall"]), fmt(r["zero_gbps"], ".0f"), fmt(r["memset_gbps"], ".0f"),
            fmt(r["bw_vs_zero"], ".2f"), fmt(r["bw_vs_memset"], ".2f"),
        )
    console.print(table)
    checks = Table(title="Targets (worst row)")
    for col in ("target", "bound", "measured", "met"):
        checks.add_column(col)
    for t in result["targets"]:
        checks.add_row(t["target"], t["bound"], fmt(t["worst"], ".2f"), {True: "yes", False: "NO", None: "-"}[t["met"]])
    console.print(checks)
    if result["memset"] is None:
        console.print("memset column skipped: no cudaMemsetAsync / cuMemsetD8Async found")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("kvcore bench zero: needs a CUDA GPU (none found); run it on a GPU machine", file=sys.stderr)
        return 2
    for name in ("blocks", "layers", "kv_heads", "head_size", "block_size", "repeats"):
        values = getattr(args, name) if name == "blocks" else [getattr(args, name)]
        if not values or min(values) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    from kvcore.runtime.zeroer import kernel as zero_kernel
    from kvcore.runtime.zeroer import zeroer as zero_module

    # NOTE: tuning knobs override the library's module defaults for this process only.
    if args.programs_per_sm:
        zero_kernel.PROGRAMS_PER_SM = args.programs_per_sm
    if args.chunk_kib:
        zero_module.CHUNK_BYTES = args.chunk_kib << 10
    result = collect(args, torch.device("cuda"))
    result["tuning"] = {"programs_per_sm": zero_kernel.PROGRAMS_PER_SM, "chunk_bytes": zero_module.CHUNK_BYTES}
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0
