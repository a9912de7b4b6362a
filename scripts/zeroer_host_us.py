"""Host microseconds per ``zero_block_ids(list)`` call and one-block device time (GPU only).

Times, on one CUDA device, for a 32-layer model (8 KV heads x 128, 16-token
blocks, bf16) in each layout family:
- ``host_us``: the call until it returns to the caller, the device idle before
  each call (median of ``--repeats``), for the default (up to 64 ids by value
  in the launch, more through the ring) and each id-staging mode of the zeroer
  with every list staged (``copy``: pinned ring + async copy, ``mapped``: the kernel reads the pinned
  ring; ``copy-triton``: the same ring with Triton's launcher instead of the driver
  launch) and for the previous path (a fresh pinned tensor per call, an async
  copy, the validating Triton launch), all in one run;
- ``list_device_us``: CUDA-event time of the same call (the id copy or the
  kernel's reads of pinned memory included), and ``part_*_us``: each step of
  the host path timed alone;
- ``one_block``: CUDA-event time of zeroing one block from device ids and from
  a host list (ids and, for affine tables, the geometry by value) with fine
  work items of 4, 8, 16 and 32 KiB, timed in alternation with
  ``cudaMemsetAsync`` of the same bytes.

Usage: ``python scripts/zeroer_host_us.py [--json-out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton

from kvcore.bench._timing import find_memset
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.runtime.zeroer import kernel as zero_kernel
from kvcore.runtime.zeroer import zeroer as zero_module
from kvcore.runtime.zeroer.ids import id_list
from kvcore.runtime.zeroer.listed import LISTED
from kvcore.specs import FullAttentionSpec

LAYERS, POOL = 32, 1024
FINE = zero_module.FINE_CHUNK_BYTES

def _caches(layout: str):
    spec = FullAttentionSpec(16, 8, 128, torch.bfloat16)
    names = [f"layers.{i}.attn" for i in range(LAYERS)]
    s = compute_layout_strides(spec, POOL, LAYERS, layout)
    tensor = KVCacheTensor(POOL * LAYERS * spec.page_size_bytes, names, s[0], s[1])
    return allocate_kv_cache(KVCacheConfig(POOL, [tensor], [KVCacheGroupSpec(names, spec)], layout), "cuda")

def host_us(fn, repeats: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]

def device_us(fn, repeats: int) -> float:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(10):
        fn()
    pairs = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)

def group_us(fns, repeats: int) -> list[float]:
    """Median CUDA-event times of ``fns`` timed in alternation (L2 flushed before each)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(10):
        for fn in fns:
            fn()
    events = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, events):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            out.append((start, end))
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) * 1e3 for s, e in out) for out in events]


def _parts(zeroer: KVBlockZeroer, ids: list[int], repeats: int) -> dict[str, float]:
    """Host time of each step of the hot path, each timed alone (median us)."""
    staging, launcher = zeroer._staging, zeroer._launchers[0]
    stream = zeroer._stream(zeroer.device.index)
    offset = staging.stage(ids, stream)
    parts = {
        "part_check_us": host_us(lambda: id_list(ids, zeroer.num_blocks), repeats)[0],
        "part_stream_us": host_us(lambda: zeroer._stream(zeroer.device.index), repeats)[0],
        "part_capturing_us": host_us(torch.cuda.is_current_stream_capturing, repeats)[0],
        "part_stage_us": host_us(lambda: staging.stage(ids, stream), repeats)[0],
        "part_launch_us": host_us(lambda: launcher.launch(staging.buffer, offset, len(ids), stream), repeats)[0],
    }
    if len(ids) <= LISTED and launcher.listed_launch_error is None:
        parts["part_listed_launch_us"] = host_us(lambda: launcher.launch_list(ids, stream), repeats)[0]
    return parts


def _old_path(zeroer: KVBlockZeroer):
    """The previous host path: pinned allocation per call, async copy, validating JIT launch."""
    alloc = zeroer._allocations[0]
    buf = torch.empty(4096, dtype=torch.int64, device="cuda")
    programs = zero_kernel.max_programs(zeroer.device)

    def call(ids: list[int]) -> None:
        values = torch.tensor(ids, dtype=torch.int64)
        dev = buf[: len(ids)]
        dev.copy_(values.pin_memory(), non_blocking=True)
        zero_kernel.launch_table(alloc.base, dev, zeroer.num_blocks, alloc.tables[0], alloc.vec_bytes // 4, programs)

    return call

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    memset = find_memset()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": []}
    gen = torch.Generator().manual_seed(0)
    for layout in ("LBNHC", "BLNHC", "LHBNC"):
        kv = _caches(layout)
        views = {n: (v, 1) for n, v in kv.items()}
        for mode in ("default", "copy", "copy-triton", "mapped"):
            os.environ["KVCORE_ZEROER_STAGING"] = "mapped" if mode == "mapped" else "copy"
            zeroer = KVBlockZeroer.from_views("cuda", views, POOL)
            for launcher in zeroer._launchers:
                if mode != "default":  # every list through the ring
                    launcher.listed_launch_error = "off for comparison"
                if mode == "copy-triton":  # the launches before the driver launch: Triton's launcher
                    launcher.driver_launch_error = "off for comparison"
            zeroer.warmup(1)
            old = _old_path(zeroer)
            for n in (1, 8, 16, 64, 65, 512):
                ids = torch.randperm(POOL, generator=gen)[:n].tolist()
                med, p90 = host_us(lambda: zeroer.zero_block_ids(ids), args.repeats)
                row = {"layout": layout, "mode": mode, "ids": n, "host_us": med, "host_us_p90": p90}
                if mode == "default":
                    row["old_host_us"], row["old_host_us_p90"] = host_us(lambda: old(ids), args.repeats)
                launcher = zeroer._launchers[0]
                row["direct_launches"] = any(v is not None for v in launcher._compiled.values())
                row["direct_launch_error"] = launcher.direct_launch_error
                row["driver_launches"] = bool(launcher._driver)
                row["driver_launch_error"] = launcher.driver_launch_error
                row["listed_launches"] = bool(launcher._listed)
                row["listed_launch_error"] = launcher.listed_launch_error
                row["driver_copy"] = zeroer._staging._driver_copy is not None
                if n in (1, 64) and mode in ("default", "copy"):
                    row.update(_parts(zeroer, ids, args.repeats))
                    row["list_device_us"] = device_us(lambda: zeroer.zero_block_ids(ids), 100)
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        one = torch.tensor([7], device="cuda")
        dev = {"layout": layout}
        for fine_kib in (4, 8, 16, 32):
            zero_module.FINE_CHUNK_BYTES = fine_kib << 10
            zeroer = KVBlockZeroer.from_views("cuda", views, POOL)
            nbytes = zeroer.bytes_per_block
            raw = zeroer._allocations[0].bytes
            dev["bytes"] = nbytes
            zeroer_us, list_us, memset_us = group_us([lambda: zeroer.zero_block_ids(one),
                                                      lambda: zeroer.zero_block_ids([7]),
                                                      lambda: memset[0](raw.data_ptr(), nbytes)], 300)
            dev[f"fine{fine_kib}_us"], dev[f"memset_with_fine{fine_kib}_us"] = zeroer_us, memset_us
            dev[f"fine{fine_kib}_vs_memset"] = zeroer_us / memset_us
            dev[f"list_fine{fine_kib}_us"], dev[f"list_fine{fine_kib}_vs_memset"] = list_us, list_us / memset_us
        zero_module.FINE_CHUNK_BYTES = FINE
        result.setdefault("one_block", []).append(dev)
        print(json.dumps(dev), flush=True)
        del kv, zeroer, views
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)

if __name__ == "__main__":
    main()
