"""Benchmark the Triton split-K decode kernel against the memory ceiling and torch SDPA.

The cache is planned and allocated through kvcore (compute_layout_strides,
KVCacheTensor, KVCacheConfig, allocate_kv_cache) in each requested layout,
filled with random K/V, and read through a shuffled block table. Reported per
layout: the decode kernel's median time, KV bytes read and GB/s; a
device-to-device ``copy_`` of the same byte count (bandwidth counted as bytes
read + written, the device's copy ceiling) and the ratio; torch SDPA on
contiguous K/V (``enable_gqa``) and the time ratio; and the max difference
against the torch backend and SDPA.

    python plugins/kvcore-triton/bench_decode.py                 # H200 target shape
    python plugins/kvcore-triton/bench_decode.py --sweep --json  # also try launch configs
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kvcore.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.layout import KVCacheLayout, compute_layout_strides
from kvcore.specs import FullAttentionSpec
from kvcore.views import allocate_kv_cache
from kvcore_triton import KernelConfig, paged_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timer(fn, device, warmup, iters):
    """Median milliseconds of ``fn`` (CUDA events on GPUs, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _allocate(args, layout, device):
    """One layer's kernel-block view of a ``--num-layers``-layer kvcore cache."""
    dtype = DTYPES[args.dtype]
    spec = FullAttentionSpec(args.block_size, args.kv_heads, args.head_size, dtype)
    blocks_per_req = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_req + 1
    strides = compute_layout_strides(spec, num_blocks, args.num_layers, layout)
    names = [f"model.layers.{i}.self_attn" for i in range(args.num_layers)]
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * args.num_layers,
        layers=names, layer_stride=strides[0], block_stride=strides[1],
    )
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(names, spec)], layout)
    view = allocate_kv_cache(config, device)[names[args.num_layers // 2]]
    gen = torch.Generator(device=device).manual_seed(0)
    view.normal_(generator=gen)
    # Block 0 stays unused; requests get shuffled blocks (a fragmented pool).
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
    table = perm[: args.batch * blocks_per_req].view(args.batch, blocks_per_req).to(device, torch.int32)
    return view, table


def _contiguous_kv(view, table, args):
    """K and V as ``[batch, kv_heads, context, head_size]`` tensors (SDPA's input)."""
    pages = view[table.long()]  # [R, nb, H, N, C]
    kv = pages.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, : args.context]
    return kv[..., : args.head_size].contiguous(), kv[..., args.head_size :].contiguous()


def _sdpa(q, k, v, scale):
    """SDPA on contiguous K/V: GQA natively when torch has it, else K/V repeated per query head."""
    try:
        F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), "enable_gqa"
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), "repeat_interleave"


def run_layout(args, layout, device, configs):
    view, table = _allocate(args, layout, device)
    gen = torch.Generator(device=device).manual_seed(2)
    query = torch.randn(args.batch, args.q_heads, args.head_size, generator=gen, device=device).to(view.dtype)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    scale = args.head_size**-0.5
    out = torch.empty(args.batch, args.q_heads, args.head_size, dtype=view.dtype, device=device)

    def decode(config):
        return lambda: paged_attention(query, view, table, qsl, seq_lens, head_size=args.head_size, scale=scale,
                                       out=out, max_query_len=1, max_seq_len=args.context, config=config)

    timed = []
    for config in configs:
        try:
            timed.append((_timer(decode(config), device, args.warmup, args.iters), config))
        except Exception as exc:  # a sweep point may not fit (shared memory, registers)
            print(f"# {layout.name} {config}: skipped ({type(exc).__name__}: {exc})")
    ms, best = min(timed, key=lambda t: t[0])
    decode(best)()
    result = out.float().clone()

    kv_bytes = args.batch * args.context * args.kv_heads * 2 * args.head_size * view.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _timer(lambda: dst.copy_(src), device, args.warmup, args.iters)
    del src, dst

    k, v = _contiguous_kv(view, table, args)
    sdpa_fn, sdpa_mode = _sdpa(query.unsqueeze(2), k, v, scale)
    sdpa_ms = _timer(sdpa_fn, device, args.warmup, args.iters)
    sdpa_diff = (sdpa_fn().squeeze(2).float() - result).abs().max().item()
    torch_diff = None
    if not args.skip_torch_check:
        import kvcore_torch

        ref = kvcore_torch.paged_attention(query, view, table, qsl, seq_lens, head_size=args.head_size, scale=scale)
        torch_diff = (ref.float() - result).abs().max().item()
    decode_gbps = kv_bytes / ms / 1e6
    copy_gbps = 2 * kv_bytes / copy_ms / 1e6
    return {
        "layout": layout.name,
        "decode_ms": ms,
        "kv_bytes": kv_bytes,
        "decode_gbps": decode_gbps,
        "copy_ms": copy_ms,
        "copy_gbps_read_plus_write": copy_gbps,
        "ratio_vs_copy": decode_gbps / copy_gbps,
        "sdpa_ms": sdpa_ms,
        "sdpa_mode": sdpa_mode,
        "sdpa_time_over_decode_time": sdpa_ms / ms,
        "max_abs_diff_vs_torch_backend": torch_diff,
        "max_abs_diff_vs_sdpa": sdpa_diff,
        "config": {"tile": best.tile, "num_warps": best.num_warps, "num_stages": best.num_stages,
                   "num_splits": best.num_splits},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="kernel block size (16, 32 or 64)")
    p.add_argument("--num-layers", type=int, default=4, help="layers sharing the tensor (BLNHC interleaves them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layouts", default="LBNHC,BLNHC")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tile", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--num-splits", type=int, default=None, help="default: enough to fill the device")
    p.add_argument("--sweep", action="store_true", help="also try tile/warps/stages/splits combinations")
    p.add_argument("--skip-torch-check", action="store_true", help="skip the (slow) torch backend comparison")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    configs = [KernelConfig(tile=args.tile, num_warps=args.num_warps, num_stages=args.num_stages,
                            num_splits=args.num_splits)]
    if args.sweep:
        configs += [
            KernelConfig(tile=t, num_warps=w, num_stages=s, num_splits=n)
            for t, w, s, n in itertools.product((32, 64, 128), (4, 8), (2, 3), (None, 1, 2, 4, 8))
        ]
    rows = [run_layout(args, KVCacheLayout.parse(name), device, configs) for name in args.layouts.split(",")]
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {k: getattr(args, k) for k in ("batch", "context", "q_heads", "kv_heads", "head_size",
                                                 "block_size", "num_layers", "dtype")},
    }
    if args.json:
        print(json.dumps({**header, "results": rows}, indent=2))
        return 0
    print(f"{header['device']}  {header['shape']}")
    print(f"{'layout':7} {'decode ms':>10} {'GB/s':>8} {'copy GB/s':>10} {'vs copy':>8} {'sdpa ms':>9} "
          f"{'sdpa/dec':>9} {'diff torch':>11} {'diff sdpa':>10}  config")
    for r in rows:
        diff = "-" if r["max_abs_diff_vs_torch_backend"] is None else f"{r['max_abs_diff_vs_torch_backend']:.2e}"
        print(f"{r['layout']:7} {r['decode_ms']:10.4f} {r['decode_gbps']:8.0f} {r['copy_gbps_read_plus_write']:10.0f} "
              f"{r['ratio_vs_copy']:8.2f} {r['sdpa_ms']:9.4f} {r['sdpa_time_over_decode_time']:9.2f} "
              f"{diff:>11} {r['max_abs_diff_vs_sdpa']:10.2e}  {r['config']}")
    print("GB/s = KV bytes read / decode time; copy GB/s = 2 x bytes / copy_ time (read + write); "
          "sdpa/dec > 1 means the Triton kernel is faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
