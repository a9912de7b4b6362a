"""``kvcore bench elastic``: what an elastic KV cache costs per layout, and grow / shrink time on a device.

From the plan alone: for ``--model`` planned for ``--max-blocks`` blocks, per
layout, the bytes of a block, its pieces, the granules (``--granularity``, 2 MiB
as on an H100/H200) it touches, how often a block-by-block grow maps new
granules and how many, and the most memory committed beyond the blocks. With
``--measure``, on ``--device`` (default: CUDA when present, else the CPU):
commit / release time of one granule and of ``--gib`` GiB, the memory given
back (``torch.cuda.mem_get_info``; resident memory on a CPU), and a grow from 2
blocks to all and back per layout (``KVCache.resize``). A CPU backs a page when it
is first written, so there a commit's time includes writing one byte per page.
"""

import argparse
import mmap
import statistics
import textwrap
import time
from collections.abc import Mapping

import torch

from kvcore._table import terminal_width
from kvcore._units import format_bytes
from kvcore.memory.backing import reserve_backing
from kvcore.memory.elastic import ElasticMemory, block_byte_ranges, merge_ranges, subtract_ranges
from kvcore.memory.layout import KVCacheLayout, block_runs
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.model_files import load_model_file
from kvcore.specs import KVCacheSpec
from kvcore_bench import emit, progress_bar, table
from kvcore_bench.options import ARGUMENTS

add_arguments = ARGUMENTS["elastic"]


def layout_cost(specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout, max_blocks: int,
                granularity: int) -> dict:
    """Growth figures of one layout from its plan (no memory): blocks are added one at a time
    and the granules each touches counted against those already committed."""
    config = plan_kv_cache(specs, layout, num_blocks=max_blocks)
    buffer = torch.empty(config.kv_cache_tensors[0].size, dtype=torch.int8, device="meta")
    # NOTE: block 0's byte runs over all layers: (start, run length, block stride) each.
    pattern = []
    for view in allocate_kv_cache(config, "meta", buffer=buffer).values():
        item = view.element_size()
        strides = [s * item for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, item)
        pattern.extend((view.storage_offset() * item + o, run, strides[0]) for o in offsets)
    committed: set[int] = set()
    touched, events, mapped, slack = 0, 0, 0, 0
    block_bytes = sum(run for _, run, _ in pattern)
    pieces = len(merge_ranges((s, s + run) for s, run, _ in pattern))
    for b in range(max_blocks):
        granules: set[int] = set()
        for start, run, stride in pattern:
            first = start + b * stride
            granules.update(range(first // granularity, (first + run - 1) // granularity + 1))
        touched += len(granules)
        new = granules - committed
        if new and b > 0:
            events += 1
            mapped += len(new)
        committed |= granules
        slack = max(slack, len(committed) * granularity - (b + 1) * block_bytes)
    return {
        "layout": layout.name, "block_bytes": block_bytes, "pieces_per_block": pieces,
        "granules_per_block": touched / max_blocks, "grow_events": events,
        "blocks_per_grow_event": max_blocks / (events + 1),
        "mappings_per_grow_event": mapped / events if events else 0.0, "max_slack_bytes": slack,
    }


def _held(device: torch.device) -> int:
    """Memory the device (or this process, on a CPU) holds now, in bytes."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _touch(backing, ranges: list[tuple[int, int]]):
    """What backs committed memory beyond ``commit``: on a CPU, writing one byte per page of
    ``ranges`` (pages are backed when first written); nothing on a GPU, whose commit maps memory."""
    if backing.tensor.device.type != "cpu" or not ranges:
        return lambda: None
    index = torch.cat([torch.arange(start, end, mmap.PAGESIZE) for start, end in ranges])
    return lambda: backing.tensor.index_fill_(0, index, 1)


def measure_backing(device: torch.device, gib: int, repeat: int) -> dict:
    """Commit / release time of one granule (median of ``repeat``) and of ``gib`` GiB; the
    memory given back."""
    size = gib * 2**30
    backing = reserve_backing(size, device)
    repeat = min(repeat, backing.size // backing.granularity - 1)
    g = backing.granularity
    commit, release = [], []
    for i in range(1, repeat + 1):  # NOTE: granule 0 may be mapped from the start (a GPU maps it)
        touch = _touch(backing, [(i * g, (i + 1) * g)])
        t0 = time.perf_counter()
        backing.commit(i * g, (i + 1) * g)
        touch()
        t1 = time.perf_counter()
        backing.decommit(i * g, (i + 1) * g)
        commit.append(t1 - t0)
        release.append(time.perf_counter() - t1)
    touch = _touch(backing, [(0, backing.size)])
    before = _held(device)
    t0 = time.perf_counter()
    backing.commit(0, backing.size)
    touch()
    t1 = time.perf_counter()
    grown = _held(device)
    t2 = time.perf_counter()
    backing.decommit(0, backing.size)
    t3 = time.perf_counter()
    after = _held(device)
    return {
        "device": str(device), "granularity": g, "gib": gib,
        "commit_granule_ms": statistics.median(commit) * 1e3,
        "release_granule_ms": statistics.median(release) * 1e3,
        "commit_gib_ms": (t1 - t0) * 1e3 / gib, "release_gib_ms": (t3 - t2) * 1e3 / gib,
        "held_grown_bytes": grown - before, "returned_bytes": grown - after,
    }


def measure_resize(specs, device: torch.device, max_blocks: int, tick=lambda: None) -> list[dict]:
    """Per layout: commit for 2 blocks, grow to ``max_blocks`` and shrink back (as ``resize``)."""
    rows = []
    for layout in KVCacheLayout:
        try:
            config = plan_kv_cache(specs, layout, num_blocks=max_blocks)
        except ValueError as exc:
            rows.append({"layout": layout.name, "refused": str(exc).splitlines()[0]})
            continue
        backing = reserve_backing(config.kv_cache_tensors[0].size, device)
        memory = ElasticMemory(backing)
        views = allocate_kv_cache(config, device, buffer=backing.tensor)
        memory.track({n: (v, 1) for n, v in views.items()})
        memory.resize(2)
        small = memory.committed_bytes
        rows_of = {n: (v, 1) for n, v in views.items()}
        g = backing.granularity
        touch = _touch(backing, subtract_ranges(block_byte_ranges(rows_of, max_blocks, g),
                                                block_byte_ranges(rows_of, 2, g)))
        t0 = time.perf_counter()
        memory.resize(max_blocks)
        touch()
        t1 = time.perf_counter()
        granules = (memory.committed_bytes - small) // backing.granularity
        memory.resize(2)
        t2 = time.perf_counter()
        rows.append({"layout": layout.name, "granules": granules, "grow_ms": (t1 - t0) * 1e3,
                     "shrink_ms": (t2 - t1) * 1e3,
                     "grow_ms_per_granule": (t1 - t0) * 1e3 / max(granules, 1),
                     "shrink_ms_per_granule": (t2 - t1) * 1e3 / max(granules, 1)})
        del memory, backing, views
        tick()
    return rows


def _print(result: dict, args: argparse.Namespace) -> None:
    print(table(f"{result['model']}: {args.max_blocks} blocks reserved, "
                f"{format_bytes(args.granularity)} granules", [
        ("layout", "layout", ""), ("block", lambda r: format_bytes(r["block_bytes"]), "s"),
        ("pieces", "pieces_per_block", "d"), ("granules/block", "granules_per_block", ".2f"),
        ("blocks/grow", "blocks_per_grow_event", ".1f"),
        ("maps/grow", "mappings_per_grow_event", ".1f"),
        ("max slack", lambda r: format_bytes(r["max_slack_bytes"]), "s"),
    ], result["layouts"]))
    if args.measure:
        b, width = result["backing"], terminal_width()
        cpu = b["device"] == "cpu"
        print()
        print(textwrap.fill(
            f"backing on {b['device']} ({format_bytes(b['granularity'])} granules): commit "
            f"{b['commit_granule_ms']:.3f} ms / release {b['release_granule_ms']:.3f} ms per granule; "
            f"{b['commit_gib_ms']:.1f} / {b['release_gib_ms']:.1f} ms per GiB; "
            f"{format_bytes(b['returned_bytes'])} of {format_bytes(b['held_grown_bytes'])} given back"
            + (" (a CPU backs a page when first written: commit times include writing one byte "
               "per page)" if cpu else ""), width))
        done = [r for r in result["resize"] if "refused" not in r]
        print(table(f"resize 2 -> {args.max_blocks} blocks and back", [
            ("layout", "layout", ""), ("granules", "granules", ","), ("grow ms", "grow_ms", ".1f"),
            ("ms/granule", "grow_ms_per_granule", ".4f"), ("shrink ms", "shrink_ms", ".1f"),
            ("ms/granule", "shrink_ms_per_granule", ".4f"),
        ], done, width))
        for r in result["resize"]:
            if "refused" in r:
                print(textwrap.fill(f"{r['layout']} refused: {r['refused']}", width))


def run(args: argparse.Namespace) -> int:
    model = load_model_file(args.model)
    result: dict = {"model": model.name, "max_blocks": args.max_blocks,
                    "granularity": args.granularity, "layouts": []}
    for layout in KVCacheLayout:
        try:
            result["layouts"].append(layout_cost(model.kv_cache_specs, layout, args.max_blocks,
                                                 args.granularity))
        except ValueError:  # NOTE: a hybrid model's mixed pages fit block-compact layouts only
            continue
    if args.measure:
        device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with progress_bar("kvcore bench elastic --measure") as start:
            tick = start(len(KVCacheLayout) + 1)
            result["backing"] = measure_backing(device, args.gib, args.repeat)
            tick()
            result["resize"] = measure_resize(model.kv_cache_specs, device, args.max_blocks, tick)
    emit(args, result, lambda r: _print(r, args))
    return 0
