"""``kvcore bench transfer``: host offload / restore and NIXL loopback against the memcpy ceiling.

For each layout, moves random (non-consecutive) blocks of a model's KV cache:
``HostKVPool.offload`` (device to pinned host) and ``restore`` (back), with
layer-compact blocks gathered on the device first and, beside it, one copy
per run (``staging=False``), each against one pinned ``cudaMemcpyAsync`` (``copy_(non_blocking=True)``) of the
same byte count measured in the same run; and, where NIXL imports, writes
and reads between two agents of one process (UCX loopback) in host memory and,
on CUDA, in device memory, beside a plain copy of the same bytes
(:mod:`kvcore.bench.transfer_nixl`). Prints the runs each block takes per layout.
Device times come from CUDA events (median of repeats); on CPU all times are
wall times.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kvcore.bench._args import layouts_arg, positive_int_arg, positive_ints_arg
from kvcore.bench._timing import Timer
from kvcore.bench.transfer_nixl import memory_kinds_arg, nixl_rows, print_rows
from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.registry import get_plugin_manager
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import FullAttentionSpec
from kvcore.transfer import HostKVPool, NixlUnavailableError, describe, plan_transfer

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class _LayoutOnlyBackend(AttentionBackend):
    """Takes any block size and layout; the benchmark never runs attention."""

    name = "bench-transfer"

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the transfer benchmark does not run attention")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model whose KV cache blocks move")
    model.add_argument("--layers", type=positive_int_arg, default=32, help="attention layers (default: %(default)s)")
    model.add_argument("--kv-heads", type=positive_int_arg, default=8, help="KV heads per layer (default: %(default)s)")
    model.add_argument("--head-size", type=positive_int_arg, default=128,
                       help="values per head, for K and for V (default: %(default)s)")
    model.add_argument("--block-size", type=positive_int_arg, default=16,
                       help="tokens per block; 16 makes 2 MiB blocks (default: %(default)s)")
    model.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="cache dtype (default: %(default)s)")
    measured = parser.add_argument_group("what is measured")
    measured.add_argument("--layouts", type=layouts_arg, default="BLNHC,BHLNC,LBNHC,LHBNC",
                          help="comma-separated layouts (default: %(default)s)")
    measured.add_argument("--blocks", type=positive_ints_arg, default="16,128,512",
                          help="comma-separated counts of blocks moved per call (default: %(default)s)")
    measured.add_argument("--device", default=None, help="cache device (default: cuda when present, else cpu)")
    measured.add_argument("--no-host", action="store_true", help="skip the host offload / restore rows")
    measured.add_argument("--nixl-blocks", type=positive_ints_arg, default="64",
                          help="comma-separated counts of blocks per NIXL loopback transfer (default: %(default)s)")
    measured.add_argument("--nixl-memory", type=memory_kinds_arg, default=None,
                          help="NIXL memory kinds, DRAM and/or VRAM (default: both on CUDA, else DRAM)")
    measured.add_argument("--no-nixl", action="store_true", help="skip the NIXL loopback rows")
    measured.add_argument("--repeats", type=positive_int_arg, default=10,
                          help="timed repeats; medians are reported (default: %(default)s)")
    measured.add_argument("--warmup", type=positive_int_arg, default=2,
                          help="untimed calls before each measurement (default: %(default)s)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    out.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON to PATH (default: none)")


def _cache(args: argparse.Namespace, layout: KVCacheLayout, num_blocks: int, device: torch.device) -> KVCache:
    spec = FullAttentionSpec(args.block_size, args.kv_heads, args.head_size, _DTYPES[args.dtype])
    specs = {f"layers.{i}.attn": spec for i in range(args.layers)}
    return KVCache.create(
        specs, dict.fromkeys(specs, _LayoutOnlyBackend), device=device, layout=layout, num_blocks=num_blocks,
        max_num_seqs=1, max_model_len=args.block_size, plugin_manager=get_plugin_manager(autoload=False),
    )


def _gbps(nbytes: int, us: float) -> float:
    return nbytes / us / 1e3


def _host_rows(args, layout, device, timer, gen) -> list[dict[str, Any]]:
    most = max(args.blocks)
    kv = _cache(args, layout, 2 * most + 1, device)
    pool = HostKVPool(kv, most)
    direct = HostKVPool(kv, most, staging=False)  # one copy per run, for comparison
    desc = describe(kv)
    device_buf = torch.empty(pool.host.numel(), dtype=torch.int8, device=device)
    rows = []
    for n in args.blocks:
        # NOTE: odd ids only, so no two blocks are neighbours: runs per block is the layout's.
        ids = (torch.randperm(most, generator=gen)[:n] * 2 + 1).tolist()
        slots = torch.randperm(most, generator=gen)[:n].tolist()
        regions = plan_transfer(desc, ids)
        nbytes = sum(r.length for r in regions)
        host, dev = pool.host[:nbytes], device_buf[:nbytes]
        row = {"layout": layout.name, "blocks": n, "bytes": nbytes, "block_bytes": nbytes // n,
               "runs": len(regions), "runs_per_block": len(regions) / n,
               "copies": pool.offload(ids, slots).num_runs,
               "direct_copies": sum(p.num_runs for p in pool.plan(ids, slots))}
        row["offload_us"] = timer.gpu_us(lambda: pool.offload(ids, slots, non_blocking=True))
        row["restore_us"] = timer.gpu_us(lambda: pool.restore(slots, ids, non_blocking=True))
        staged = row["copies"] != row["direct_copies"]
        row["direct_offload_us"] = timer.gpu_us(lambda: direct.offload(ids, slots, non_blocking=True)) if staged else None
        row["direct_restore_us"] = timer.gpu_us(lambda: direct.restore(slots, ids, non_blocking=True)) if staged else None
        row["d2h_memcpy_us"] = timer.gpu_us(lambda: host.copy_(dev, non_blocking=True))
        row["h2d_memcpy_us"] = timer.gpu_us(lambda: dev.copy_(host, non_blocking=True))
        for key in ("offload", "restore", "d2h_memcpy", "h2d_memcpy", "direct_offload", "direct_restore"):
            row[f"{key}_gbps"] = _gbps(nbytes, row[f"{key}_us"]) if row[f"{key}_us"] else None
        row["offload_vs_memcpy"] = row["d2h_memcpy_us"] / row["offload_us"]
        row["restore_vs_memcpy"] = row["h2d_memcpy_us"] / row["restore_us"]
        rows.append(row)
    del kv, pool, direct, device_buf
    return rows


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every layout; the result is what ``--json`` prints."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    memories = args.nixl_memory or (["DRAM", "VRAM"] if device.type == "cuda" else ["DRAM"])
    if "VRAM" in memories and device.type != "cuda":
        raise ValueError(f"--nixl-memory VRAM needs a CUDA --device, got {device}; use --nixl-memory DRAM")
    timer = Timer(device, args.repeats, args.warmup) if not args.no_host else None
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "model": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")},
        "host": [], "nixl": [], "nixl_skipped": None, "nixl_failed": {},
    }
    for layout in args.layouts if timer is not None else ():
        result["host"] += _host_rows(args, layout, device, timer, gen)
        _release(device)
    del timer
    if args.no_nixl:
        result["nixl_skipped"] = "--no-nixl"
        return result
    for memory in memories:
        try:
            for layout in args.layouts:
                result["nixl"] += nixl_rows(args, lambda lay, n, on: _cache(args, lay, n, on), layout, memory,
                                            device, gen)
                _release(device)
        except NixlUnavailableError as exc:
            result["nixl_skipped"] = str(exc)
            break
        except Exception as exc:  # NOTE: NIXL/UCX raise their own types; the other rows still report
            result["nixl_failed"][memory] = f"{type(exc).__name__}: {exc}"
    return result


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _print(result: dict[str, Any]) -> None:
    print(f"KV block offload / restore on {result['device']} ({result['model']})")
    head = ("layout", "blocks", "KiB/blk", "runs/blk", "copies", "offload GB/s", "d2h memcpy",
            "x memcpy", "restore GB/s", "h2d memcpy", "x memcpy")
    print("  ".join(f"{h:>12}" for h in head))
    for r in result["host"]:
        cells = (r["layout"], r["blocks"], r["block_bytes"] // 1024, f"{r['runs_per_block']:.1f}", r["copies"],
                 f"{r['offload_gbps']:.1f}", f"{r['d2h_memcpy_gbps']:.1f}", f"{r['offload_vs_memcpy']:.3f}",
                 f"{r['restore_gbps']:.1f}", f"{r['h2d_memcpy_gbps']:.1f}", f"{r['restore_vs_memcpy']:.3f}")
        print("  ".join(f"{c:>12}" for c in cells))
    direct = [r for r in result["host"] if r["direct_offload_us"]]
    if direct:
        print("one copy per run instead of a device gather (staging=False): offload / restore GB/s")
        for r in direct:
            print(f"{r['layout']:>12}  {r['blocks']:>12}  {r['direct_copies']:>8} copies  "
                  f"{r['direct_offload_gbps']:.1f} / {r['direct_restore_gbps']:.1f}")
    if result["nixl_skipped"]:
        print(f"NIXL loopback skipped: {result['nixl_skipped']}")
    if result["nixl"]:
        print_rows(result["nixl"])
    for memory, error in result["nixl_failed"].items():
        print(f"NIXL loopback in {memory} failed: {error}")


def run(args: argparse.Namespace) -> int:
    result = collect(args)
    text = json.dumps(result, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        _print(result)
    return 0
