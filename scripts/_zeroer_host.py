"""Host time of ``KVBlockZeroer.zero_block_ids(list)`` for 1 to 64 ids (CUDA), one JSON line.

The tree under test is the one ``PYTHONPATH`` puts first, so two trees (``BEFORE`` and this one)
can be timed alternately in one run (``bash scripts/gpu_check.sh zeroer``). The cache: 32 layers,
8 KV heads x 128, bf16, 16-token blocks, LBNHC, 8,192 blocks. Per id count: ``--calls`` calls, the
device idle before each; the median and the best, in microseconds.

    PYTHONPATH=. python scripts/_zeroer_host.py --label after [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvcore
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import FullAttentionSpec

LAYERS, POOL, COUNTS = 32, 8192, (1, 2, 4, 8, 16, 32, 64)


def host_us(call, calls: int) -> list[float]:
    """Host microseconds of each of ``calls`` calls, the device idle before each."""
    for _ in range(20):
        call()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        call()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    spec, names = FullAttentionSpec(16, 8, 128, torch.bfloat16), [f"layers.{i}.attn" for i in range(LAYERS)]
    s = compute_layout_strides(spec, POOL, LAYERS, "LBNHC")
    tensor = KVCacheTensor(POOL * LAYERS * spec.page_size_bytes, names, s[0], s[1])
    kv = allocate_kv_cache(KVCacheConfig(POOL, [tensor], [KVCacheGroupSpec(names, spec)], "LBNHC"), "cuda")
    zeroer = KVBlockZeroer.from_views("cuda", {n: (kv[n], 1) for n in names}, POOL)
    zeroer.warmup(0)
    gen = torch.Generator().manual_seed(0)
    row: dict[str, object] = {"label": args.label, "kvcore": kvcore.__file__, "calls": args.calls}
    for n in COUNTS:
        ids = (torch.randperm(POOL - 1, generator=gen)[:n] + 1).tolist()
        times = host_us(lambda ids=ids: zeroer.zero_block_ids(ids), args.calls)
        row[f"ids_{n}_median_us"] = round(statistics.median(times), 2)
        row[f"ids_{n}_best_us"] = round(min(times), 2)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
