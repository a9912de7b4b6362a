"""Host time of ``KVBlockZeroer.zero_block_ids(list)`` and where it goes (CUDA; issue #23).

Run once per zeroer tree (``PYTHONPATH`` picks it), alternating, in one GPU call, so "before" and
"after" come from the same run: 32 layers, 8 KV heads x 128, bf16, 16-token blocks, LBNHC, 8,192
blocks; the median of 300 calls, device idle before each. With ``--parts`` it also times the pieces
of one call of today's zeroer on its own (1 id): the compiled launcher's ``run`` alone, packing the
ids, reading the stream, the capture check.
    PYTHONPATH=.old python scripts/gpu_zeroer_probe.py --label before
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import FullAttentionSpec

LAYERS, POOL = 32, 8192


def timed(fn, n: int = 300, sync: bool = True) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--parts", action="store_true")
    args = ap.parse_args()
    spec, names = FullAttentionSpec(16, 8, 128, torch.bfloat16), [f"layers.{i}.attn" for i in range(LAYERS)]
    s = compute_layout_strides(spec, POOL, LAYERS, "LBNHC")
    tensor = KVCacheTensor(POOL * LAYERS * spec.page_size_bytes, names, s[0], s[1])
    kv = allocate_kv_cache(KVCacheConfig(POOL, [tensor], [KVCacheGroupSpec(names, spec)], "LBNHC"), "cuda")
    zeroer = KVBlockZeroer.from_views("cuda", {n: (kv[n], 1) for n in names}, POOL)
    zeroer.warmup(0)
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for n in (1, 8, 64, 65, 512):
        ids = torch.randperm(POOL, generator=gen)[:n].tolist()
        rows[f"ids_{n}"] = timed(lambda: zeroer.zero_block_ids(ids))
    if args.parts:
        from kvcore.runtime.zeroer import kernel
        from kvcore.runtime.zeroer.zeroer import current_stream_id

        ids = [5]
        launcher = zeroer._launchers[0]
        zeroer.zero_block_ids(ids)
        compiled = next(iter(launcher._compiled.values()))
        words = kernel.pack_words(ids)
        stream = current_stream_id(0)
        table_address, chunks = launcher._shapes[-1]
        run_args = (launcher._base_address, table_address, 1, launcher.num_blocks, table_address, chunks, *words,
                    launcher.vec, kernel.ROWS, True)
        rows["part_run_only"] = timed(lambda: compiled.run(min(launcher.programs, chunks), 1, 1, stream,
                                                           compiled.function, compiled.packed_metadata, None, None,
                                                           None, *run_args))
        rows["part_launcher_launch"] = timed(lambda: launcher.launch(None, 1, stream, words))
        rows["part_pack_words"] = timed(lambda: kernel.pack_words(ids), sync=False)
        rows["part_stream_id"] = timed(lambda: current_stream_id(0), sync=False)
        rows["part_refuse_capture"] = timed(zeroer._id_buffer.refuse_capture, sync=False)
        rows["part_hooked"] = timed(kernel._hooked, sync=False)
        rows["part_torch_empty_launch"] = timed(lambda: torch.cuda._sleep(0))
    print(json.dumps({"label": args.label, **{k: round(v, 2) for k, v in rows.items()}}), flush=True)


if __name__ == "__main__":
    main()
