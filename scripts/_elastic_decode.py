"""Triton decode bandwidth over an elastic KV cache against a plain allocation, in every layout.

For each layout one model-sized tensor (``--layers`` layers, GQA, bf16) is
planned twice: plainly for the blocks the batch reads, and elastic with
address space for ``--reserve`` times as many blocks of which only those are
committed (CUDA virtual memory, 2 MiB granules). The same shuffled block
table is decoded over both with kvcore-triton's ``paged_attention``, timed in
alternation (median device time); the outputs must agree (bf16 rounding).
Prints one line per layout and a JSON summary (``--json PATH``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugins", "kvcore-triton"))
from bench_decode import _timer  # noqa: E402

from kvcore import FullAttentionSpec, KVCacheLayout, plan_kv_cache  # noqa: E402
from kvcore.memory.backing import reserve_backing  # noqa: E402
from kvcore.memory.elastic import ElasticMemory  # noqa: E402
from kvcore.memory.views import allocate_kv_cache  # noqa: E402
from kvcore_triton import paged_attention  # noqa: E402


def layer_view(specs, layout, num_blocks, device, elastic_blocks=None):
    """The middle layer's view of a plain cache of ``num_blocks``, or of an elastic one reserved for
    ``elastic_blocks``."""
    names = list(specs)
    if elastic_blocks is None:
        views = allocate_kv_cache(plan_kv_cache(specs, layout, num_blocks=num_blocks), device)
        return views[names[len(names) // 2]], None
    config = plan_kv_cache(specs, layout, num_blocks=elastic_blocks)
    backing = reserve_backing(config.kv_cache_tensors[0].size, device)
    views = allocate_kv_cache(config, device, buffer=backing.tensor)
    memory = ElasticMemory(backing)
    memory.track({n: (v, 1) for n, v in views.items()})
    memory.resize(num_blocks)
    return views[names[len(names) // 2]], memory


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reserve", type=int, default=4, help="elastic address space, in multiples of the blocks read")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--layouts", default=",".join(layout.name for layout in KVCacheLayout))
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cuda (a CPU run, tiny and interpreted, checks the script)")
    args = p.parse_args()
    device = torch.device(args.device)
    block, kv_heads, q_heads, head = 16, 8, 32, 128
    spec = FullAttentionSpec(block, kv_heads, head, torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn": spec for i in range(args.layers)}
    per_req = args.context // block
    num_blocks = args.batch * per_req + 1
    gen = torch.Generator().manual_seed(1)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: args.batch * per_req]
    table = table.view(args.batch, per_req).to(device, torch.int32)
    query = torch.randn(args.batch, q_heads, head, dtype=torch.bfloat16).to(device)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    kv_bytes = args.batch * args.context * kv_heads * 2 * head * 2
    rows = []
    for name in args.layouts.split(","):
        layout = KVCacheLayout.parse(name)
        plain, _ = layer_view(specs, layout, num_blocks, device)
        elastic, memory = layer_view(specs, layout, num_blocks, device, elastic_blocks=num_blocks * args.reserve)
        plain.copy_(torch.randn(plain.shape, device=device, dtype=torch.float32))
        elastic[:num_blocks].copy_(plain)
        outs = [torch.empty(args.batch, q_heads, head, device=device, dtype=torch.bfloat16) for _ in range(2)]
        fns = [lambda v=v, o=o: paged_attention(query, v, table, qsl, seq_lens, head_size=head, scale=head**-0.5,
                                                out=o, max_query_len=1, max_seq_len=args.context)
               for v, o in zip((plain, elastic), outs)]
        times = [[], []]
        for _ in range(args.rounds):
            for i, fn in enumerate(fns):
                times[i].append(_timer(fn, device, 3, args.iters))
        ms = [statistics.median(t) for t in times]
        row = {"layout": layout.name, "plain_ms": ms[0], "elastic_ms": ms[1],
               "plain_gbps": kv_bytes / ms[0] / 1e6, "elastic_gbps": kv_bytes / ms[1] / 1e6,
               "ratio": ms[0] / ms[1], "max_diff": (outs[0].float() - outs[1].float()).abs().max().item(),
               "reserved_gib": memory.backing.size / 2**30, "committed_gib": memory.committed_bytes / 2**30}
        rows.append(row)
        print(f"{layout.name:6} plain {row['plain_gbps']:7.0f} GB/s  elastic {row['elastic_gbps']:7.0f} GB/s  "
              f"ratio {row['ratio']:.3f} (target >= 0.97)  max diff {row['max_diff']:.1e}  "
              f"committed {row['committed_gib']:.2f} of {row['reserved_gib']:.2f} GiB reserved", flush=True)
        del plain, elastic, memory, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["max_diff"] <= 1e-2 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
