"""``kvcore bench transfer``: host offload / restore and NIXL transfers against copy ceilings.

For each layout, moves random, never adjacent blocks of a model's KV cache:
``HostKVPool.offload`` / ``restore`` against one pinned
``copy_(non_blocking=True)`` of as many bytes, measured in the same run (CUDA
events, median of repeats; wall times on CPU); and, where NIXL imports, NIXL
writes and reads to a peer agent (:mod:`kvcore_bench.transfer_nixl`). Without
CUDA the defaults are CPU-sized and everything runs on one torch thread (on a
shared machine, waking more times the OS scheduler, not the copy); reference
copies are repeated at least 20 times, and one slower than a tenth of this
machine's large-copy bandwidth (plus a call's overhead) is reported as
implausible.

``--descriptors N`` counts instead what NIXL is handed for one transfer of N
scattered (odd) or consecutive blocks: the copies (runs adjacent on both sides
merged), the Nx5 rows ``NixlAgent`` prepares once per side, and the host time
of building both sides' lists per call (a paired plan, Nx3 arrays and, where
NIXL imports, its ``nixlXferDList``) against the agent's prepared path
(indices into both prepared lists).
"""

import argparse
import contextlib
import functools
import logging
import os
import textwrap
from typing import Any

import torch

from kvcore._table import terminal_width
from kvcore._units import format_bytes
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.registry import get_plugin_manager
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import FullAttentionSpec
from kvcore.transfer import HostKVPool, NixlUnavailableError, describe, plan_transfer
from kvcore.transfer.nixl_api import PreparedRuns, nixl_api, paired_indices, xfer_arrays
from kvcore.transfer.pairs import pair_runs
from kvcore.transfer.regions import group_selection, whole_block_patterns
from kvcore_bench import emit, progress_bar, table
from kvcore_bench._timing import Timer
from kvcore_bench.options import ARGUMENTS, CPU_TRANSFER_DEFAULTS, GPU_TRANSFER_DEFAULTS
from kvcore_bench.transfer_nixl import gbps, nixl_rows, print_rows, rate

add_arguments = ARGUMENTS["transfer"]


class _LayoutOnlyBackend(AttentionBackend):
    """Takes any block size and layout; the benchmark never runs attention."""

    name = "bench-transfer"

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the transfer benchmark does not run attention")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` with the options left unset taken from the GPU or the CPU defaults."""
    args = argparse.Namespace(**vars(args))
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device.type == "cuda"
    for key, value in (GPU_TRANSFER_DEFAULTS if cuda else CPU_TRANSFER_DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.nixl_peer = args.nixl_peer or ("process" if cuda else "local")
    return args


def model_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")}


def build_cache(model: dict[str, Any], layout: str, num_blocks: int, device: str) -> KVCache:
    """The benchmark's cache (a module function, so a spawned NIXL peer can build it too)."""
    spec = FullAttentionSpec(model["block_size"], model["kv_heads"], model["head_size"],
                             getattr(torch, model["dtype"]))
    specs = {f"layers.{i}.attn": spec for i in range(model["layers"])}
    return KVCache.create(
        specs, dict.fromkeys(specs, _LayoutOnlyBackend), device=device, layout=layout,
        num_blocks=num_blocks, max_num_seqs=1, max_model_len=model["block_size"],
        plugin_manager=get_plugin_manager(autoload=False),
    )


#: A reference copy this many times slower than the machine's large copies (plus a call's
#: overhead, in µs) measures the machine's load, not a copy.
IMPLAUSIBLE, CALL_US = 10, 20.0


def reference_timer(args: argparse.Namespace) -> Timer:
    """The timer of plain reference copies: on a CPU at least 20 repeats after 3 warm-ups."""
    cpu = args.device.type == "cpu"
    return Timer(args.device, max(args.repeats, 20) if cpu else args.repeats,
                 max(args.warmup, 3) if cpu else args.warmup)


def copy_bandwidth(device: torch.device) -> float | None:
    """GB/s of a warm 64 MiB host copy (CPU; GPU references are CUDA events)."""
    if device.type != "cpu":
        return None
    src = torch.ones(64 << 20, dtype=torch.int8)
    dst = torch.empty_like(src)
    return gbps(src.numel(), Timer(device, 5, 2).wall_us(lambda: dst.copy_(src)))


def implausible(result: dict[str, Any]) -> list[str]:
    """The reference copies of ``result`` too slow for this machine, as ``'GB/s (bytes)'``."""
    machine = result.get("copy_gbps")
    slow = []
    for kind, keys in (("host", ("d2h_memcpy", "h2d_memcpy")), ("nixl", ("copy",))):
        for row in result[kind] if machine else ():
            for key in keys:
                us = row.get(f"{key}_us")
                if us is not None and us > IMPLAUSIBLE * (row["bytes"] / (machine * 1e3) + CALL_US):
                    slow.append(f"{row[f'{key}_gbps']:.2f} GB/s ({format_bytes(row['bytes'])})")
    return slow


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device) -> Any:
    """On a CPU, run on one torch thread for the duration (restored after)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _host_rows(args, layout, timer, gen, tick) -> list[dict[str, Any]]:
    most = max(args.blocks)
    kv = build_cache(model_of(args), layout.name, 2 * most + 1, str(args.device))
    pool = HostKVPool(kv, most)
    device_buf = torch.empty(pool.host.numel(), dtype=torch.int8, device=args.device)
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
        reference = reference_timer(args)
        row["d2h_memcpy_us"] = reference.gpu_us(lambda: host.copy_(dev, non_blocking=True))
        row["h2d_memcpy_us"] = reference.gpu_us(lambda: dev.copy_(host, non_blocking=True))
        for key in ("offload", "restore", "d2h_memcpy", "h2d_memcpy"):
            row[f"{key}_gbps"] = gbps(nbytes, row[f"{key}_us"])
        row["offload_vs_memcpy"] = row["d2h_memcpy_us"] / row["offload_us"]
        row["restore_vs_memcpy"] = row["h2d_memcpy_us"] / row["restore_us"]
        rows.append(row)
        tick()
    return rows


def collect(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """Measure every layout: what ``--json`` prints. ``progress(total)`` returns a tick."""
    args = resolve(args)
    cuda = args.device.type == "cuda"
    memories = args.nixl_memory or (["VRAM", "VRAM-DRAM", "DRAM"] if cuda else ["DRAM"])
    gpu_kinds = [m for m in memories if "VRAM" in m]
    if gpu_kinds and not cuda:
        raise ValueError(f"--nixl-memory {','.join(gpu_kinds)} needs a CUDA --device, got "
                         f"{args.device}; use --nixl-memory DRAM")
    steps = (0 if args.no_host else len(args.blocks)) + (
        0 if args.no_nixl else len(memories) * len(args.nixl_blocks)
    )
    tick = progress(steps * len(args.layouts)) if progress is not None else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(args.device) if cuda else str(args.device),
        "model": model_of(args), "nixl_peer": args.nixl_peer,
        "nixl_progress_thread": args.nixl_progress_thread,
        "host": [], "nixl": [], "nixl_skipped": None, "nixl_failed": {},
        "torch_threads": torch.get_num_threads(), "copy_gbps": copy_bandwidth(args.device),
    }
    if not args.no_host:
        timer = Timer(args.device, args.repeats, args.warmup)
        for layout in args.layouts:
            result["host"] += _host_rows(args, layout, timer, gen, tick)
            torch.cuda.empty_cache()
        del timer
    if args.no_nixl:
        result["nixl_skipped"] = "--no-nixl"
        return result
    for memory in memories:
        try:
            for layout in args.layouts:
                make = functools.partial(build_cache, model_of(args), layout.name)
                result["nixl"] += nixl_rows(args, make, memory, args.device, gen, args.nixl_peer,
                                            tick)
                torch.cuda.empty_cache()
        except NixlUnavailableError as exc:
            result["nixl_skipped"] = str(exc)
            break
        except Exception as exc:  # NOTE: NIXL/UCX raise their own types; the other rows report
            result["nixl_failed"][memory] = f"{type(exc).__name__}: {exc}"
    return result


def _nixl_lists() -> Any:
    """A function turning an ``Nx3`` array into NIXL's descriptor list, or None without NIXL."""
    try:
        agent_cls, config_cls = nixl_api()
        agent = agent_cls("kvcore-descriptor-bench", config_cls(backends=[]))
    except Exception:  # NOTE: NIXL may be absent (NixlUnavailableError) or unable to start here
        return None
    return lambda array: agent.get_xfer_descs(array, "DRAM")


def _per_call(desc: Any, ids: torch.Tensor, to_nixl: Any) -> int:
    """Both sides' descriptor lists built per call (the peer: this cache); the copies."""
    patterns = whole_block_patterns(desc, group_selection(desc, None))
    arrays = xfer_arrays(pair_runs(patterns, ids, patterns, ids), desc, desc)
    if to_nixl is not None:
        for array in arrays:
            to_nixl(array)
    return len(arrays[0])


def descriptor_rows(args: argparse.Namespace) -> list[dict]:
    """One row per layout and id kind for ``args.descriptors`` ids (a cache of head size 1)."""
    n = args.descriptors
    model = {**model_of(args), "head_size": 1}
    to_nixl = _nixl_lists()
    timer = Timer(torch.device("cpu"), repeats=5, warmup=1)
    rows = []
    for layout in args.layouts:
        desc = describe(build_cache(model, layout.name, 2 * n + 1, "cpu"))
        prepared = PreparedRuns(desc, whole_block_patterns(desc, group_selection(desc, None)))
        for kind, ids in (("scattered", torch.arange(n) * 2 + 1),
                          ("consecutive", torch.arange(n) + 1)):
            copies = _per_call(desc, ids, to_nixl)
            rows.append({
                "layout": layout.name, "blocks": n, "ids": kind, "descriptors": copies,
                "per_block": copies / n, "prepared_rows": len(prepared.rows()),
                "build_ms": timer.wall_us(lambda: _per_call(desc, ids, to_nixl)) / 1e3,
                "prepared_ms": timer.wall_us(
                    lambda: paired_indices(prepared, prepared, ids, ids)) / 1e3,
                "nixl_dlist": to_nixl is not None,
            })
    return rows


def _print(result: dict[str, Any]) -> None:
    width = terminal_width()
    m = result["model"]
    if result["host"]:
        print(table(
            f"KV block offload / restore on {result['device']}: {m['layers']} layers, "
            f"{m['kv_heads']} KV heads of {m['head_size']}, {m['block_size']}-token blocks, "
            f"{m['dtype']}", [
                ("layout", "layout", ""), ("blocks", "blocks", "d"),
                ("block", lambda r: format_bytes(r["block_bytes"]), "s"),
                ("runs/blk", "runs_per_block", ".0f"), ("copies", "copies", "d"),
                ("offload GB/s", lambda r: rate(r["offload_gbps"]), "s"),
                ("x memcpy", "offload_vs_memcpy", ".3f"),
                ("restore GB/s", lambda r: rate(r["restore_gbps"]), "s"),
                ("x memcpy", "restore_vs_memcpy", ".3f"),
            ], result["host"], width))
        first = result["host"][0]
        print(textwrap.fill(
            "x memcpy: one pinned copy_(non_blocking=True) of the same bytes, device to host for "
            "offload and host to device for restore, measured in the same run "
            f"({first['d2h_memcpy_gbps']:.1f} / {first['h2d_memcpy_gbps']:.1f} GB/s in the first "
            "row).", width))
        print()
    if result["nixl_skipped"]:
        print(textwrap.fill(f"NIXL rows skipped: {result['nixl_skipped']}", width))
    if result["copy_gbps"]:
        print(textwrap.fill(
            f"On a CPU every row runs on {result['torch_threads']} torch thread; a 64 MiB copy runs at "
            f"{result['copy_gbps']:.1f} GB/s here.", width))
    if result["nixl"]:
        print_rows(result["nixl"], width)
    for memory, error in result["nixl_failed"].items():
        print(textwrap.fill(f"NIXL in {memory} failed: {error}", width))
    slow = implausible(result)
    if slow:
        print(textwrap.fill(
            f"warning: {len(slow)} reference copies were implausibly slow for this machine "
            f"({', '.join(slow[:3])}{', ...' if len(slow) > 3 else ''}): the machine is busy, and "
            "ratios against them mean little.", width))


def _print_descriptors(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    nixl = " and NIXL's nixlXferDList" if rows and rows[0]["nixl_dlist"] else ""
    print(table(
        f"NIXL descriptors of one transfer ({args.layers} layers, {args.kv_heads} KV heads): "
        "copies after merging; Nx5 rows prepared once per side; host ms per call (median), per "
        f"call: plan, Nx3 arrays{nixl} for both sides; prepared: indices", [
            ("layout", "layout", ""), ("blocks", "blocks", "d"), ("ids", "ids", ""),
            ("copies", "descriptors", "d"), ("per block", "per_block", ".3g"),
            ("prepared rows", "prepared_rows", "d"), ("per-call ms", "build_ms", ".2f"),
            ("prepared ms", "prepared_ms", ".2f"),
        ], rows, terminal_width()))


def _quiet_nixl() -> None:
    """Keep NIXL's and UCX's INFO lines out of the report (a user's own setting wins)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    logging.getLogger("nixl").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    _quiet_nixl()
    if args.descriptors:
        args = resolve(args)
        emit(args, descriptor_rows(args), lambda rows: _print_descriptors(rows, args))
        return 0
    with progress_bar("kvcore bench transfer") as progress, one_thread_on_cpu(resolve(args).device):
        result = collect(args, progress)
    emit(args, result, _print)
    return 0
