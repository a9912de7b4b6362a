"""Decode through kvcore's views: FlashInfer vs FlashInfer on its own paged tensor, kvcore-triton, SDPA.

One shape (default: 64 requests x 4,096 tokens, GQA 32/8, head 128, bf16,
16-token pages), each request's pages at random places of a shared pool.
Prints each path's time and KV read bandwidth, and the ratio FlashInfer
through kvcore's views / FlashInfer native (the price of kvcore's layouts).

    python plugins/kvcore-flashinfer/bench_flashinfer_decode.py --json-out results.json
"""

from __future__ import annotations

import argparse
import json

import torch

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.specs import FullAttentionSpec
from kvcore.testing import build_cache
from kvcore_flashinfer import FlashInferAttentionBackend, FlashInferMetadataBuilder, page_table
from kvcore_flashinfer._runtime import flashinfer, kv_pair


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(args) -> list[dict]:
    fi = flashinfer()
    from kvcore_triton import paged_attention

    b, n, hq, h, d, page = args.batch, args.context, args.q_heads, args.kv_heads, args.head_size, args.page
    dtype, scale = torch.bfloat16, d**-0.5
    pages = b * -(-n // page)
    gen = torch.Generator().manual_seed(0)
    table = (torch.randperm(pages + 1, generator=gen)[:pages] + 1).view(b, -1).to(torch.int32)
    lens = torch.full((b,), n, dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=gen).to(dtype).cuda()
    kv_bytes = 2 * b * n * h * d * 2
    rows = []

    def add(name, ms, out):
        rows.append({"path": name, "ms": ms, "tb_per_s": kv_bytes / ms / 1e9, "out": out})

    table_d, lens_d = table.cuda(), lens.cuda()
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    for layout in args.layouts.split(","):
        view = build_cache(layout, page, pages + 1, h, d, dtype, device="cuda", num_layers=1)[0]
        view.normal_()
        spec = FullAttentionSpec(page, h, d, dtype)
        builder = FlashInferMetadataBuilder(spec, ["l"], "cuda", max_num_seqs=b, max_model_len=n)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, seq_lens=lens_d, block_table_tensor=table_d,
            slot_mapping=torch.full((b,), -1, dtype=torch.int64, device="cuda"), num_reqs=b,
            num_actual_tokens=b, max_query_len=1, max_seq_len=n,
        )
        metadata = builder.build(0, common)
        zeros = torch.zeros(b, h, d, dtype=dtype, device="cuda")
        out = FlashInferAttentionBackend.forward(q, zeros, zeros, view, metadata, head_size=d, scale=scale)
        wrapper = next(iter(metadata.planned.values()))
        kind, k_cache, v_cache = kv_pair(view, d)
        add(f"flashinfer via kvcore {layout} ({kind})", _time_ms(lambda: wrapper.run(q, (k_cache, v_cache)), args.iters),
            out)
        tri = lambda: paged_attention(q, view, table_d, qsl, lens_d, head_size=d, scale=scale,  # noqa: E731
                                      max_query_len=1, max_seq_len=n)
        add(f"kvcore-triton {layout}", _time_ms(tri, args.iters), tri())
        if layout == args.layouts.split(",")[0]:
            # FlashInfer's own [pages, 2, page, heads, dim] tensor holding the same K/V.
            native = torch.stack([k_cache, v_cache], dim=1).contiguous() if kind == "NHD" else \
                torch.stack([k_cache.transpose(1, 2), v_cache.transpose(1, 2)], dim=1).contiguous()
            pt = page_table(table, lens, page)
            ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
            own = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            own.plan(pt.indptr, pt.indices, pt.last_page_len, hq, h, d, page, q_data_type=dtype,
                     kv_data_type=dtype, sm_scale=scale)
            add("flashinfer native NHD", _time_ms(lambda: own.run(q, native), args.iters), own.run(q, native))
            k_dense = native[table.cuda().long(), 0].flatten(1, 2).transpose(1, 2)  # [b, h, n, d]
            v_dense = native[table.cuda().long(), 1].flatten(1, 2).transpose(1, 2)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q.unsqueeze(2), k_dense, v_dense, scale=scale, enable_gqa=True)
            add("torch SDPA (contiguous K/V)", _time_ms(sdpa, args.iters), sdpa().squeeze(2))
    reference = rows[0]["out"].float()
    for row in rows:
        row["max_abs_diff"] = (row.pop("out").float() - reference).abs().max().item()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--layouts", default="LBNHC,LBHNC,BLNHC")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    rows = run(args)
    native = next(r["ms"] for r in rows if r["path"].startswith("flashinfer native"))
    print(f"decode {args.batch} x {args.context} tokens, GQA {args.q_heads}/{args.kv_heads}, head {args.head_size}, "
          f"bf16, pages of {args.page} ({torch.cuda.get_device_name()})")
    for r in rows:
        r["native_time_over_time"] = native / r["ms"]
        print(f"  {r['path']:<38} {r['ms'] * 1e3:8.1f} us  {r['tb_per_s']:5.2f} TB/s  "
              f"native/this {r['native_time_over_time']:5.3f}  diff {r['max_abs_diff']:.1e}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
