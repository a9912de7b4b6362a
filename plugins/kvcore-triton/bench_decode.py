"""Benchmark the Triton split-K decode kernel against the memory ceiling and torch SDPA.

The cache is planned and allocated through kvcore (compute_layout_strides,
KVCacheTensor, KVCacheConfig, allocate_kv_cache) in each requested layout,
filled with random K/V, and read through a shuffled block table. Reported per
layout: the decode kernel's median time, KV bytes read and GB/s; a
device-to-device ``copy_`` of the same byte count (bandwidth counted as bytes
read + written, the device's copy ceiling) and the ratio; torch SDPA on
contiguous K/V (``enable_gqa``) and the time ratio; and the max difference
against the torch backend and SDPA. ``--flashinfer`` adds FlashInfer's decode
through kvcore's view and on its own contiguous paged tensor of the same K/V
(kvcore-flashinfer), with the ratio native / views.

The sweep (``--sweep``) times the decode read paths (``DECODE_VARIANTS``: TMA, pointers)
and launch configs in two stages: every variant at a few anchor configs,
then the best ``--sweep-top`` variants over tile x warps x stages x splits,
most promising points first, until ``--budget-s`` seconds have passed. Each
point is compiled once and timed on every layout; one line per (block size,
layout, variant, config), then the best per layout.

    python plugins/kvcore-triton/bench_decode.py                 # H200 target shape
    python plugins/kvcore-triton/bench_decode.py --sweep --block-size 16,64 --skip-torch-check
    python plugins/kvcore-triton/bench_decode.py --flashinfer --block-size 16,64   # + FlashInfer rows
    python plugins/kvcore-triton/bench_decode.py --kv-cache-dtype fp8,int8_per_token_head,fp8_per_token_head

``--kv-cache-dtype MODE[,MODE...]`` also decodes the same K/V stored quantized (written by the
Triton store kernel) with the configs of ``quant_configs`` (on CUDA; the first only elsewhere),
derived from the best bf16 config of each layout: one ``QTRY`` line each (time, bytes read, data
and scales, the speed-up over the bf16 decode, the relative L2 error against SDPA on the bf16
K/V), a ``QUANT`` line with the fastest, and a ``TARGET`` line per mode with a speed target (met
or not by the ``default`` launch, the one a caller without a config gets; the fastest beside it);
where FlashInfer is installed (CUDA), FlashInfer's fp8 decode of the per-tensor modes too.

    python plugins/kvcore-triton/bench_decode.py --block-size 64 --layouts LBNHC --skip-torch-check \
        --kv-cache-dtype fp8,int8_per_token_head,fp8_per_token_head
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import attrs
import torch
import torch.nn.functional as F

from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.memory.views import allocate_kv_cache, allocate_scale_views
from kvcore.plugins.backend import KVQuantState
from kvcore.settings import Settings
from kvcore.specs import FullAttentionSpec
from kvcore.specs.quant import KV_CACHE_DTYPES, parse_kv_cache_dtype, quantize_specs
from kvcore_triton import KernelConfig, paged_attention
from kvcore_triton.attention import DECODE_VARIANTS, _tma_descriptor, quant_decode_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


#: GPU cycles of ``torch.cuda._sleep`` queued ahead of each timed call (about 1 ms on an H200).
SLEEP_CYCLES = 2_000_000


def _timer(fn, device, warmup, iters):
    """Median device milliseconds of ``fn`` (CUDA events on GPUs, wall clock elsewhere).

    The GPU is kept busy (``torch.cuda._sleep``) while the host enqueues ``fn``, so the
    events bracket device work only: host overhead (argument checks, launch) is
    reported by ``_host_us``, not here. Both SDPA and the decode are timed this way.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP_CYCLES)
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


def _host_us(fn, device, iters):
    """Median host microseconds to enqueue ``fn`` while the GPU is busy (launch overhead)."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(times)


def _allocate(args, layout, device, block_size, mode="auto"):
    """One layer's kernel-block view of a ``--num-layers``-layer kvcore cache (stored as ``mode``),
    its block table and its quantization (None unquantized)."""
    dtype = DTYPES[args.dtype]
    spec = quantize_specs({"l": FullAttentionSpec(block_size, args.kv_heads, args.head_size, dtype)}, mode)["l"]
    blocks_per_req = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_req + 1
    strides = compute_layout_strides(spec, num_blocks, args.num_layers, layout)
    names = [f"model.layers.{i}.self_attn" for i in range(args.num_layers)]
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * args.num_layers,
        layers=names, layer_stride=strides[0], block_stride=strides[1],
    )
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(names, spec)], layout)
    name = names[args.num_layers // 2]
    view = allocate_kv_cache(config, device)[name]
    # Block 0 stays unused; requests get shuffled blocks (a fragmented pool).
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
    table = perm[: args.batch * blocks_per_req].view(args.batch, blocks_per_req).to(device, torch.int32)
    if spec.kv_quant is not None:
        raw = torch.empty(0, dtype=torch.int8, device=device).set_(view.untyped_storage())
        scales = allocate_scale_views(config, raw).get(name)
        return view, table, KVQuantState(spec.kv_quant, spec.dtype, 1.0, 1.0, scales)
    gen = torch.Generator(device=device).manual_seed(0)
    view.normal_(generator=gen)
    return view, table, None


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


class Case:
    """One layout's cache, batch and baselines (copy, SDPA) at one kernel block size."""

    def __init__(self, args, layout, device, block_size):
        self.layout, self.block_size = layout, block_size
        self.view, self.table, _ = _allocate(args, layout, device, block_size)
        gen = torch.Generator(device=device).manual_seed(2)
        self.query = torch.randn(args.batch, args.q_heads, args.head_size, generator=gen, device=device)
        self.query = self.query.to(self.view.dtype)
        self.qsl = torch.arange(args.batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
        self.scale = args.head_size**-0.5
        self.out = torch.empty(args.batch, args.q_heads, args.head_size, dtype=self.view.dtype, device=device)
        self.args = args
        self.kv_bytes = args.batch * args.context * args.kv_heads * 2 * args.head_size * self.view.element_size()
        src = torch.empty(self.kv_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        self.copy_ms = _timer(lambda: dst.copy_(src), device, args.warmup, args.iters)
        src = dst = None
        k, v = _contiguous_kv(self.view, self.table, args)
        sdpa_fn, self.sdpa_mode = _sdpa(self.query.unsqueeze(2), k, v, self.scale)
        self.sdpa_ms = _timer(sdpa_fn, device, args.warmup, args.iters)
        self.sdpa_host_us = _host_us(sdpa_fn, device, args.iters)
        self.sdpa_out = sdpa_fn().squeeze(2).float()
        del k, v

    def baseline(self) -> dict:
        return {
            "layout": self.layout.name, "block_size": self.block_size, "kv_bytes": self.kv_bytes,
            "copy_ms": self.copy_ms, "copy_gbps_read_plus_write": 2 * self.kv_bytes / self.copy_ms / 1e6,
            "sdpa_ms": self.sdpa_ms, "sdpa_gbps": self.kv_bytes / self.sdpa_ms / 1e6, "sdpa_mode": self.sdpa_mode,
            "sdpa_host_us": self.sdpa_host_us,
        }

    def decode(self, config):
        a = self.args
        return lambda: paged_attention(self.query, self.view, self.table, self.qsl, self.seq_lens,
                                       head_size=a.head_size, scale=self.scale, out=self.out, max_query_len=1,
                                       max_seq_len=a.context, config=config)

    def measure(self, variant, config, device, warmup, iters) -> dict:
        ms = _timer(self.decode(config), device, warmup, iters)
        diff = (self.out.float() - self.sdpa_out).abs().max().item()
        tma = _tma_descriptor(self.view, config, self.args.head_size, self.args.head_size) is not None
        return {
            "block_size": self.block_size, "layout": self.layout.name, "variant": variant,
            "path": "tma" if tma else "pointer", "grid": "head" if tma else "request",
            "config": _config_dict(config), "decode_ms": ms, "decode_gbps": self.kv_bytes / ms / 1e6,
            "sdpa_time_over_decode_time": self.sdpa_ms / ms, "max_abs_diff_vs_sdpa": diff,
        }

    def flashinfer(self, device) -> list[dict]:
        """FlashInfer on this case's view and on its own contiguous paged copy (``--flashinfer``)."""
        from kvcore_flashinfer.bench import decode_rows

        rows = decode_rows(self.view, self.table, self.seq_lens, self.query, scale=self.scale,
                           time_ms=lambda fn: _timer(fn, device, self.args.warmup, self.args.iters),
                           reference=self.sdpa_out)
        for r in rows:
            r.update(block_size=self.block_size, layout=self.layout.name, gbps=self.kv_bytes / r["ms"] / 1e6,
                     sdpa_time_over_time=self.sdpa_ms / r["ms"])
        return rows

    def torch_diff(self, config) -> float:
        import kvcore_torch

        self.decode(config)()
        a = self.args
        ref = kvcore_torch.paged_attention(self.query, self.view, self.table, self.qsl, self.seq_lens,
                                           head_size=a.head_size, scale=self.scale)
        return (ref.float() - self.out.float()).abs().max().item()


class QuantCase:
    """A bf16 case's K/V stored as ``mode`` (same block table), decoded with its scales."""

    def __init__(self, case: Case, mode: str, device) -> None:
        from kvcore_triton import write_kv

        args = self.args = case.args
        self.case, self.mode = case, mode
        self.view, table, self.kv_quant = _allocate(args, case.layout, device, case.block_size, mode)
        assert torch.equal(table, case.table)
        # NOTE: every cached token, written by the Triton store kernel (quantized in the same launch).
        bs = case.block_size
        tokens = case.view[case.table.long()].permute(0, 1, 3, 2, 4).flatten(0, 2)
        per_req = -(-args.context // bs) * bs
        keep = (torch.arange(per_req, device=device) < args.context).repeat(args.batch)
        slots = (case.table.long()[:, :, None] * bs + torch.arange(bs, device=device)).flatten()
        tokens, slots = tokens[keep], slots[keep]
        for start in range(0, slots.numel(), 1 << 16):
            part = slice(start, start + (1 << 16))
            write_kv(self.view, tokens[part, :, : args.head_size], tokens[part, :, args.head_size :],
                     slots[part], args.head_size, kv_quant=self.kv_quant)
        data = args.batch * args.context * args.kv_heads * 2 * args.head_size * self.view.element_size()
        self.kv_bytes = data + (args.batch * args.context * args.kv_heads * 8 if mode.endswith("per_token_head") else 0)

    def measure(self, config, device, bf16_ms) -> dict:
        c, a = self.case, self.args

        def decode():
            return paged_attention(c.query, self.view, c.table, c.qsl, c.seq_lens, head_size=a.head_size,
                                   scale=c.scale, out=c.out, max_query_len=1, max_seq_len=a.context,
                                   config=config, kv_quant=self.kv_quant)

        ms = _timer(decode, device, a.warmup, a.iters)
        ref = c.sdpa_out
        tma = _tma_descriptor(self.view, config, a.head_size, a.head_size) is not None
        return {"block_size": c.block_size, "layout": c.layout.name, "kv_cache_dtype": self.mode,
                "config": {**_config_dict(config), "tma": config.tma, "stage_v": config.stage_v},
                "path": "tma" if tma else "pointer", "decode_ms": ms, "kv_bytes": self.kv_bytes,
                "decode_gbps": self.kv_bytes / ms / 1e6, "bf16_decode_ms": bf16_ms, "speedup_over_bf16": bf16_ms / ms,
                "rel_l2_vs_sdpa": ((c.out.float() - ref).norm() / ref.norm()).item()}

    def flashinfer(self, device) -> list[dict]:
        """FlashInfer's fp8 decode (CUDA cores and tensor cores) of this per-tensor cache."""
        from kvcore_flashinfer.bench import decode_rows

        c, rows = self.case, []
        for tensor_cores in (False, True):
            for r in decode_rows(self.view, c.table, c.seq_lens, c.query, scale=c.scale, kv_quant=self.kv_quant,
                                 time_ms=lambda fn: _timer(fn, device, c.args.warmup, c.args.iters),
                                 reference=c.sdpa_out, tensor_cores=tensor_cores):
                r.update(block_size=c.block_size, layout=c.layout.name, gbps=self.kv_bytes / r["ms"] / 1e6,
                         sdpa_time_over_time=c.sdpa_ms / r["ms"], kv_cache_dtype=self.mode)
                rows.append(r)
        return rows


def quant_configs(best: KernelConfig, default: KernelConfig) -> dict[str, KernelConfig]:
    """The decode configs each quantized mode tries: ``default``, the launch a caller gets without a
    config, then variations of it and of the layout's fastest bf16 one.

    An 8-bit tile carries half the bytes of a bf16 one: ``num_stages`` 5 or more keeps two TMA tiles
    in flight per program (3 and 4 keep one, 7 three); ``stage_v`` widens V tiles as loaded (no
    byte-wide operand loads) at the cost of a 16-bit shared-memory buffer; one warp per program
    holds less shared memory, so more programs share an SM; four warps or 32-token tiles trade the
    other way. Where TMA reads the tiles ``w1_s6`` repeats the default: two timings of one launch
    show the run's spread. A pointer-path point covers caches whose tiles TMA cannot read; two
    splits double the programs.
    """
    staged = attrs.evolve(best, stage_v=True)
    return {
        "default": default,
        "bf16cfg": best,
        "w1_s6": attrs.evolve(best, num_warps=1, num_stages=6),
        "w1_sv_s6": attrs.evolve(staged, num_warps=1, num_stages=6),
        "w1_s5": attrs.evolve(best, num_warps=1, num_stages=5),
        "sv_s5": attrs.evolve(staged, num_stages=5),
        "s5": attrs.evolve(best, num_stages=5),
        "sv_w4_s5": attrs.evolve(staged, num_warps=4, num_stages=5),
        "sv_t32_s7": attrs.evolve(staged, tile=32, num_stages=7),
        "ptr_sv_s5": attrs.evolve(staged, tma=False, num_stages=5),
        "ptr_w1_s6": attrs.evolve(best, tma=False, num_warps=1, num_stages=6),
        "w1_s6_sp2": attrs.evolve(default, num_splits=2),
    }


#: The decode speed-ups over bf16 a quantized mode aims for (and fp8's time in ms at the target shape).
QUANT_TARGETS = {"fp8_e4m3": (1.8, 0.150), "int8_per_token_head": (1.7, None), "fp8_per_token_head": (1.7, None)}


def _quant_line(r) -> str:
    c = r["config"]
    knobs = (f"t{c['tile']} w{c['num_warps'] or 'd'} s{c['num_stages']} sp={c['num_splits'] or 'auto'} "
             f"{r['path']}{' stage_v' if c['stage_v'] else ''}")
    return (f"bs={r['block_size']:<3} {r['layout']:6} {r['kv_cache_dtype']:20} {r['variant']:13} {knobs:30} "
            f"{r['decode_ms']:8.4f} ms {r['decode_gbps']:6.0f} GB/s  x{r['speedup_over_bf16']:.2f} over bf16 "
            f"({r['bf16_decode_ms']:.4f} ms)  rel_l2_vs_sdpa {r['rel_l2_vs_sdpa']:.2e}")


def _flashinfer_installed(device) -> bool:
    import importlib.util

    return device.type == "cuda" and all(importlib.util.find_spec(m) for m in ("flashinfer", "kvcore_flashinfer"))


def _config_dict(config) -> dict:
    return {"tile": config.tile, "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_splits": config.num_splits}


def _line(r) -> str:
    c = r["config"]
    sp = "auto" if c["num_splits"] is None else c["num_splits"]
    return (f"bs={r['block_size']:<3} {r['layout']:6} {r['variant']:15} {r['path']:7} {r['grid']:7} "
            f"t{c['tile']:<3} w{c['num_warps'] or 'd'} "
            f"s{c['num_stages']} sp={sp:<4} {r['decode_ms']:8.4f} ms {r['decode_gbps']:6.0f} GB/s "
            f"sdpa/dec {r['sdpa_time_over_decode_time']:5.3f} diff {r['max_abs_diff_vs_sdpa']:.1e}")


def _splits(text):
    return [None if x == "auto" else int(x) for x in text.split(",")]


def _ints(text):
    return [int(x) for x in text.split(",")]


def _points(args):
    """(stage, variant, KernelConfig) in the order they are tried."""
    base = dict(tile=args.tile, num_warps=args.num_warps, num_stages=args.num_stages, num_splits=args.num_splits)
    variants = args.variants.split(",") if args.variants else (list(DECODE_VARIANTS) if args.sweep else ["base"])
    unknown = [v for v in variants if v not in DECODE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; choose from {sorted(DECODE_VARIANTS)}")
    if args.sweep and args.num_splits is None:
        base["num_splits"] = 1  # NOTE: the anchors use the best split count measured so far
    anchors = [base] if not args.sweep else [dict(base, **a) for a in
                                             ({}, {"num_stages": 4}, {"tile": 128, "num_warps": 8})]
    first = [(1, v, KernelConfig(**a, **DECODE_VARIANTS[v])) for v in variants for a in anchors]
    grid = sorted(itertools.product(_ints(args.tiles), _ints(args.warps), _ints(args.stages), _splits(args.splits)),
                  key=lambda p: sum(lst.index(x) for lst, x in zip(
                      (_ints(args.tiles), _ints(args.warps), _ints(args.stages), _splits(args.splits)), p)))
    return variants, first, grid


def sweep(args, device, block_size, cases, out_rows, deadline):
    variants, first, grid = _points(args)
    seen = set()

    def try_point(stage, variant, config):
        if (variant, config) in seen or time.monotonic() > deadline:
            return
        seen.add((variant, config))
        for case in cases:
            try:
                row = case.measure(variant, config, device, args.warmup, args.iters)
            except Exception as exc:  # a point may not fit (shared memory, registers)
                print(f"# bs={block_size} {case.layout.name} {variant} {_config_dict(config)}: skipped "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})", flush=True)
                return
            row["stage"] = stage
            out_rows.append(row)
            print(_line(row), flush=True)

    for stage, variant, config in first:
        try_point(stage, variant, config)
    if not args.sweep:
        return
    mine = [r for r in out_rows if r["block_size"] == block_size]
    best_ms = {v: min((r["decode_ms"] for r in mine if r["variant"] == v), default=float("inf")) for v in variants}
    top = sorted(variants, key=best_ms.get)[: args.sweep_top]
    print(f"# bs={block_size} stage 2 variants: {top}", flush=True)
    for t, w, s, n in grid:
        for variant in top:
            try_point(2, variant, KernelConfig(tile=t, num_warps=w, num_stages=s, num_splits=n,
                                               **DECODE_VARIANTS[variant]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", default="16", help="kernel block sizes, comma separated (16, 32, 64)")
    p.add_argument("--num-layers", type=int, default=4, help="layers sharing the tensor (BLNHC interleaves them)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layouts", default="LBNHC,BLNHC")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--tile", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=None, help="default: the kernel's own (2 for decode)")
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--num-splits", type=int, default=None, help="default: enough to fill the device")
    p.add_argument("--variants", default=None,
                   help=f"comma separated names from {sorted(DECODE_VARIANTS)} (default: base; --sweep: all)")
    p.add_argument("--sweep", action="store_true", help="variants at anchor configs, then a config grid")
    p.add_argument("--sweep-top", type=int, default=3, help="variants carried into the config grid")
    p.add_argument("--tiles", default="64,128,32")
    p.add_argument("--warps", default="2,4")
    p.add_argument("--stages", default="4,3,2")
    p.add_argument("--splits", default="1,auto,2", help="'auto' fills the device")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="stop trying new points after this many seconds (shared by the block sizes)")
    p.add_argument("--skip-torch-check", action="store_true", help="skip the (slow) torch backend comparison")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="also print one JSON object with every row at the end")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help=f"comma-separated KV cache modes decoded beside bf16, from {list(KV_CACHE_DTYPES)}")
    p.add_argument("--flashinfer", action="store_true",
                   help="also time FlashInfer through kvcore's views and on its own paged tensor (kvcore-flashinfer)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.kv_cache_dtype.split(",") if m.strip() and m.strip() != "auto"]
    unknown = [m for m in modes if m not in KV_CACHE_DTYPES]
    if unknown:
        p.error(f"unknown --kv-cache-dtype {unknown}; choose from {list(KV_CACHE_DTYPES)}")
    device = torch.device(args.device)
    if device.type == "cpu" and not Settings.from_env().triton_interpret:
        print("bench_decode.py times Triton kernels on a CUDA GPU; on CPU run it with "
              "TRITON_INTERPRET=1 (tiny shapes only, times are meaningless)", file=sys.stderr)
        return 2
    started = time.monotonic()
    block_sizes = _ints(args.block_size)
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {k: getattr(args, k) for k in ("batch", "context", "q_heads", "kv_heads", "head_size",
                                                 "num_layers", "dtype")},
        "block_sizes": block_sizes,
    }
    print(f"# {header['device']}  {header['shape']}  block sizes {block_sizes}", flush=True)
    rows, baselines, best, flashinfer_rows, quant_rows = [], [], [], [], []
    for i, block_size in enumerate(block_sizes):
        cases = [Case(args, KVCacheLayout.parse(name), device, block_size) for name in args.layouts.split(",")]
        for case in cases:
            b = case.baseline()
            baselines.append(b)
            print(f"# baseline bs={block_size} {b['layout']}: copy {b['copy_ms']:.4f} ms "
                  f"{b['copy_gbps_read_plus_write']:.0f} GB/s (read+write); sdpa ({b['sdpa_mode']}) "
                  f"{b['sdpa_ms']:.4f} ms {b['sdpa_gbps']:.0f} GB/s read, host {b['sdpa_host_us']:.0f} us", flush=True)
        # NOTE: each block size gets an equal share of what is left of the budget.
        deadline = time.monotonic() + (args.budget_s - (time.monotonic() - started)) / (len(block_sizes) - i)
        sweep(args, device, block_size, cases, rows, deadline)
        for case in cases:
            mine = [r for r in rows if r["layout"] == case.layout.name and r["block_size"] == block_size]
            if not mine:
                continue
            top = dict(min(mine, key=lambda r: r["decode_ms"]))
            c, v = top["config"], DECODE_VARIANTS[top["variant"]]
            top["decode_host_us"] = _host_us(case.decode(KernelConfig(**c, **v)), device, args.iters)
            if not args.skip_torch_check:
                top["max_abs_diff_vs_torch_backend"] = case.torch_diff(KernelConfig(**c, **v))
            best.append(top)
        for case in cases if modes else ():
            mine = [r for r in best if r["layout"] == case.layout.name and r["block_size"] == block_size]
            if not mine:
                continue
            c, v = mine[0]["config"], DECODE_VARIANTS[mine[0]["variant"]]
            for mode in modes:
                quant = QuantCase(case, mode, device)
                configs = quant_configs(KernelConfig(**c, **v), quant_decode_config(quant.view, *[args.head_size] * 2))
                tried = []
                for name, config in configs.items() if device.type == "cuda" else list(configs.items())[:1]:
                    try:
                        row = {**quant.measure(config, device, mine[0]["decode_ms"]), "variant": name}
                    except Exception as exc:  # a config may not fit (shared memory, registers)
                        print(f"# {mode} {name}: skipped ({type(exc).__name__})", flush=True)
                        continue
                    tried.append(row)
                    print("QTRY  " + _quant_line(row), flush=True)
                default = next((row for row in tried if row["variant"] == "default"), None)
                r = dict(min(tried, key=lambda row: row["decode_ms"]), tried=len(tried),
                         default_ms=default and default["decode_ms"],
                         default_speedup=default and default["speedup_over_bf16"])
                quant_rows.append(r)
                print("QUANT " + _quant_line(r), flush=True)
                if quant.kv_quant.kv_quant == "per_tensor" and _flashinfer_installed(device):
                    for fr in quant.flashinfer(device):
                        flashinfer_rows.append(fr)
                        print(f"FLASHINFER bs={block_size:<3} {fr['layout']:6} {fr['path']:46} {fr['ms']:.4f} ms "
                              f"{fr['gbps']:.0f} GB/s native/this {fr['native_time_over_time']:.3f}", flush=True)
                del quant
        for case in cases if args.flashinfer else ():
            for r in case.flashinfer(device):
                flashinfer_rows.append(r)
                print(f"FLASHINFER bs={block_size:<3} {r['layout']:6} {r['path']:34} {r['ms']:.4f} ms "
                      f"{r['gbps']:.0f} GB/s sdpa/this {r['sdpa_time_over_time']:.3f} "
                      f"native/this {r['native_time_over_time']:.3f} diff_sdpa {r['max_abs_diff']:.1e}", flush=True)
        del cases
    for r in quant_rows if device.type == "cuda" else ():  # NOTE: interpreter times say nothing
        mode = parse_kv_cache_dtype(r["kv_cache_dtype"])
        if mode in QUANT_TARGETS and r["default_ms"] is not None:
            speedup, ms = QUANT_TARGETS[mode]
            met = r["default_speedup"] >= speedup and (ms is None or r["default_ms"] <= ms)
            wanted = f"x{speedup}" + ("" if ms is None else f" and <= {ms * 1e3:.0f} us")
            print(f"TARGET bs={r['block_size']:<3} {r['layout']:6} {mode:20} default x{r['default_speedup']:.2f} "
                  f"{r['default_ms'] * 1e3:.0f} us (wanted {wanted}): {'met' if met else 'NOT met'}; "
                  f"best of {r['tried']}: {r['variant']} x{r['speedup_over_bf16']:.2f}", flush=True)
    print(f"# best per layout (sdpa/dec >= 1: paged decode no slower than SDPA); "
          f"{len(rows)} rows in {time.monotonic() - started:.0f} s", flush=True)
    for r in sorted(best, key=lambda r: (r["layout"], r["decode_ms"])):
        extra = r.get("max_abs_diff_vs_torch_backend")
        print("BEST " + _line(r) + f" host {r['decode_host_us']:.0f} us"
              + ("" if extra is None else f" diff_torch {extra:.1e}"), flush=True)
    if args.json:
        print(json.dumps({**header, "baselines": baselines, "rows": rows, "best": best,
                          "flashinfer": flashinfer_rows, "quantized": quant_rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
