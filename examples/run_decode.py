"""Serve a small random-weight GQA transformer from a kvcore paged KV cache.

A batch of prompts of different lengths goes through chunked prefill and
greedy decode; sequences are admitted as others finish, so freed blocks are
recycled (and zeroed by one launch per step). Every layer's attention output
is compared with dense attention over the same tokens.

Run: python examples/run_decode.py [--backend torch|triton|flashinfer] [--layout BLNHC] [--head-size 128]
     [--block-size 32] [--hybrid] [--device cpu|cuda] [--num-seqs 12] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

# NOTE: without a GPU, Triton kernels run on CPU tensors through the interpreter,
# which must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _args import ArgumentParser, device_arg, run  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402
from tiny_engine import Engine  # noqa: E402
from tiny_model import ModelConfig, TinyTransformer  # noqa: E402

from kvcore import KVCache  # noqa: E402
from kvcore.plugins import get_backend  # noqa: E402

TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="triton" if cuda else "torch", help="registered backend name")
    p.add_argument("--layout", default=None, help="KV cache layout (default: the backends' preference)")
    p.add_argument("--block-size", type=int, default=16, help="manager block size in tokens")
    p.add_argument("--head-size", type=int, default=32, help="attention head size (flashinfer: 64, 128 or 256)")
    p.add_argument("--device", type=device_arg, default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--hybrid", action="store_true", help="make every odd layer a 64-token sliding window")
    p.add_argument("--num-seqs", type=int, default=12, help="sequences to serve")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--num-blocks", type=int, default=40, help="KV cache blocks (block 0 is the null block)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="sequences in flight at once")
    p.add_argument("--token-budget", type=int, default=64, help="tokens per step (prefill chunk limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true",
                   help="skip the dense reference, NaN poisoning and zero checks (to time the engine)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = ModelConfig(sliding_window=64 if args.hybrid else None, head_size=args.head_size)
    model = TinyTransformer(config, dtype=dtype, device=device, seed=args.seed)
    backend = get_backend(args.backend)
    max_model_len = 128

    kv = KVCache.create(
        config.kv_cache_specs(args.block_size, dtype),
        {config.layer_name(i): backend for i in range(config.num_layers)},
        device=device,
        layout=args.layout,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
    )
    kv.zeroer.warmup(kv.num_blocks)
    check = not args.no_check
    engine = Engine(model, kv, backend, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                    check=check, poison_freed=check, check_zeroed=check)
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.num_seqs):
        prompt_len = int(torch.randint(8, 97, (), generator=gen))
        max_new = int(torch.randint(4, 25, (), generator=gen))
        engine.add_request(torch.randint(config.vocab_size, (prompt_len,), generator=gen).tolist(), max_new)
    total = sum(s.prompt_len + s.max_new_tokens - 1 for s in engine.waiting)

    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" and args.backend == "triton" else ""
    console.print(
        f"[bold]kvcore decode demo[/]: backend [cyan]{args.backend}[/]{interp} on {device}, {dtype}, "
        f"layout [cyan]{kv.layout.name}[/], {kv.num_groups} KV cache group(s), {kv.num_blocks} blocks of "
        f"{args.block_size} tokens, kernel block sizes {kv.kernel_block_sizes}"
    )
    steps = 0
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
               TextColumn("[dim]{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("serving", total=total, status="")
        while engine.has_work and (args.steps is None or steps < args.steps):
            processed = engine.step()
            steps += 1
            pool = kv.block_pool
            status = (f"{len(engine.running)} running, {len(engine.finished)} done, "
                      f"{pool.num_used_blocks}/{pool.num_blocks - 1} blocks")
            progress.update(task, advance=processed, status=status)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    tol = TOLERANCE[dtype]
    if not check:
        console.print(f"{engine.tokens_processed} tokens in {steps} steps: "
                      f"{engine.tokens_processed / elapsed:,.0f} tokens/s (checks off)")
        return 0
    table = Table(title="run summary", show_header=False)
    generated = sum(len(s.tokens) - s.prompt_len for s in engine.finished + engine.running)
    rows = [
        ("steps", f"{steps}"),
        ("sequences finished", f"{len(engine.finished)} / {args.num_seqs}"),
        ("tokens processed", f"{engine.tokens_processed} ({generated} generated)"),
        ("throughput", f"{engine.tokens_processed / elapsed:,.0f} tokens/s"
                       + (" (with dense checks)" if check else "")),
        ("recycled block allocations", f"{engine.recycled_blocks} (each zeroed before reuse)"),
        ("blocks freed by sliding windows", f"{engine.window_freed_blocks}"),
        ("max |paged - dense| attention", f"{engine.max_abs_error:.2e} (tolerance {tol:.0e})"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    if engine.out_unwritten:
        layers = ", ".join(sorted(engine.out_unwritten))
        console.print(f"[bold red]FAIL[/]: {args.backend}'s forward returned its output without writing it into "
                      f"out= ({layers}); when out is given, write into it and return it")
        return 1
    if not engine.max_abs_error <= tol:
        console.print(f"[bold red]FAIL[/]: paged attention differs from dense by {engine.max_abs_error:.3e} > {tol}")
        return 1
    console.print("[bold green]OK[/]: paged attention matches dense attention at every step and layer")
    return 0


if __name__ == "__main__":
    run(main, "run_decode.py")
