"""Serve HF transformers models through kvcore and check every token against model.generate.

A random-weight Llama, a Gemma 3 (sliding and full layers: two KV cache
groups) and a Granite 4.0-H-style hybrid (a Mamba2 mixer layer, whose state
lives in a kvcore state group, beside an attention layer) are built from
configs, or a local checkpoint is loaded with ``--model DIR``. Prompts of mixed lengths go through ``kvcore.hf.Engine``
with few blocks and few sequences at once, so requests wait, blocks are
recycled and zeroed, and sliding windows hand blocks back. Each request's
tokens must equal ``model.generate`` on that prompt alone; a mismatch exits
with status 1. A warm-up pass and a steady-state pass are timed separately.

Run: python examples/serve_hf.py [--arch llama,gemma3,granitemoehybrid | --model DIR] [--backend torch|triton]
     [--device cpu|cuda] [--requests 12] [--max-new-tokens 16] [--prefix-caching]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

# NOTE: without a GPU, Triton kernels run on CPU tensors through the interpreter,
# which must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _args import ArgumentParser, device_arg, run  # noqa: E402
from rich.console import Console  # noqa: E402

from kvcore._table import Column, render  # noqa: E402
from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import ARCHITECTURES, load_model, model_config, random_model  # noqa: E402
from kvcore.hf.specs import is_hybrid  # noqa: E402

#: The demo's model shape: small enough for a CPU, large enough to make attention matter.
DEMO_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama,gemma3,granitemoehybrid",
                   help=f"random-weight models to serve: {sorted(ARCHITECTURES)}")
    p.add_argument("--model", default=None, metavar="DIR", help="a local checkpoint directory instead")
    p.add_argument("--backend", default="triton" if cuda else "torch", help="registered backend name")
    p.add_argument("--device", type=device_arg, default="cuda" if cuda else "cpu")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--num-blocks", type=int, default=16, help="KV cache blocks (block 0 is the null block)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4, help="requests running at once")
    p.add_argument("--max-batched-tokens", type=int, default=64, help="tokens per step")
    p.add_argument("--prefix-caching", action="store_true", help="share a common prompt prefix's blocks")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    common = torch.randint(3, vocab, (32,), generator=gen).tolist() if args.prefix_caching else []
    lengths = torch.randint(4, 65, (args.requests,), generator=gen).tolist()
    return [common + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def serve(name: str, model, args: argparse.Namespace, console: Console) -> dict:
    prompts = make_prompts(args, model.config.vocab_size)
    start = time.perf_counter()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    hf_s = time.perf_counter() - start
    # NOTE: a hybrid's mixer states are per sequence, not per block: no prefix of them can be cached.
    caching = args.prefix_caching and not is_hybrid(model.config)
    engine = Engine(model, backend=args.backend, block_size=args.block_size, num_blocks=args.num_blocks,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                    enable_prefix_caching=caching)
    timings, outputs = [], []
    for _ in range(2):  # warm-up (kernel compilation, graph capture), then steady state
        start = time.perf_counter()
        outputs.append(engine.generate(prompts, args.max_new_tokens))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    stats = engine.stats()
    generated = sum(len(o) for o in expected)
    mismatches = [i for i, (a, b) in enumerate(zip(outputs[-1], expected)) if a != b]
    mismatches += [i for i, (a, b) in enumerate(zip(outputs[0], expected)) if a != b and i not in mismatches]
    groups = engine.kv.config.kv_cache_groups
    console.print(
        f"[bold]{name}[/]: {type(model).__name__}, {len(groups)} KV cache group(s) "
        f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}), {engine.kv.num_blocks} blocks of "
        f"{args.block_size} tokens, layout {engine.kv.layout.name}, backend {args.backend} on {model.device}"
    )
    return {
        "name": name, "generated": generated, "hf_tps": generated / hf_s,
        "warm_tps": generated / timings[0], "steady_tps": generated / timings[1], "stats": stats,
        "mismatches": mismatches, "requests": len(prompts),
    }


def report(rows: list[dict], console: Console) -> None:
    speed = [Column("model")] + [Column(c, right=True) for c in ("tokens", "warm-up", "steady", "generate")]
    speed.append(Column("equal"))
    console.print(render(speed, [
        [r["name"], f"{r['generated']}", f"{r['warm_tps']:,.0f}", f"{r['steady_tps']:,.0f}", f"{r['hf_tps']:,.0f}",
         "all" if not r["mismatches"] else f"{r['requests'] - len(r['mismatches'])} of {r['requests']}"]
        for r in rows
    ], title="tokens/s: kvcore.hf.Engine (warm-up, steady) and model.generate"), highlight=False)
    counts = ("steps", "prefill", "decode", "preempted", "zeroed", "win-freed", "hits")
    console.print(render([Column("model")] + [Column(c, right=True) for c in counts], [
        [r["name"], *(f"{v:,}" for v in (
            r["stats"].steps, r["stats"].prefill_tokens, r["stats"].decode_tokens, r["stats"].preemptions,
            r["stats"].blocks_zeroed, r["stats"].window_freed_blocks, r["stats"].prefix_cache_hits))]
        for r in rows
    ], title="what the engine did (both passes)"), highlight=False)
    console.print("model.generate runs one prompt at a time; the engine batches them (tokens/s are "
                  "wall-clock on this machine, including Python overhead).", style="dim")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    device = torch.device(args.device)
    if args.model:
        models = {os.path.basename(os.path.normpath(args.model)): load_model(args.model, dtype=torch.float32,
                                                                             device=args.device)}
    else:
        models = {arch: random_model(model_config(arch, **DEMO_SHAPE), device=device, seed=args.seed)
                  for arch in args.arch.split(",")}
    rows = [serve(name, model, args, console) for name, model in models.items()]
    report(rows, console)
    bad = [(r["name"], r["mismatches"]) for r in rows if r["mismatches"]]
    if bad:
        console.print(f"[bold red]FAIL[/]: tokens differ from model.generate for {bad}")
        return 1
    console.print("[bold green]OK[/]: every request's tokens equal model.generate on that prompt alone")
    return 0


if __name__ == "__main__":
    run(main, "serve_hf.py")
