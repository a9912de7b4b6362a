"""Disaggregated serving of an HF model: prefill in one process, decode in another, KV moved by NIXL.

Both processes serve the same random-weight HF model (a Llama, or a Gemma 3
with sliding and full layers in two KV cache groups) through
``kvcore.hf.Engine`` with prefix caching on. The prefill process runs every
prompt (``generate(prompts, 1)``) and names each prompt's cached full
blocks per KV cache group (``kvcore.hf.disagg.export_prefix``; a sliding
window group only the blocks inside its window). It sends its NIXL metadata
(which carries the KV cache descriptor) and those block lists to the decode
process over a local Pipe. The decode process connects, reserves blocks of
its own pool (``reserve_prefix``), reads the prompts' blocks into them
(``NixlAgent.read_blocks``, one call per group), records them in its prefix
cache (``import_prefix``) and generates: each prompt hits its prefix, so only
the last partial block is computed. The decode tokens must equal a
one-process ``Engine.generate`` and ``model.generate``, which this script
also runs, and the decode engine's stats must show the transferred tokens
skipped; otherwise it exits with status 1. It prints how long the decode
process took to read the prompts' KV, and the transport NIXL used.

With CUDA present both engines (and the one-process check) run on the GPU
(``--device cuda``, the default there): two processes on one GPU, where UCX
can move the blocks with ``cuda_ipc``. Each process allocates its KV cache
before it creates its NIXL agent, so a CUDA context exists when UCX starts.

Run: python examples/disaggregated.py [--arch llama|gemma3] [--layout BLNHC] [--prompts 3]
     [--new-tokens 8] [--block-size 16] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import textwrap
import time
from typing import Any

import torch

# NOTE: the triton backend plugin imports triton; without a GPU it must run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.disagg import PrefixBlocks, export_prefix, import_prefix, release_prefix, reserve_prefix  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore.transfer import NixlAgent  # noqa: E402  (NIXL itself: pip install kvcore[nixl])


def build_engine(args: argparse.Namespace, num_blocks: int) -> Engine:
    """The random-weight model of ``args.arch`` (same seed, same weights in every process) in an Engine."""
    model = random_model(model_config(args.arch), seed=args.seed, device=args.device)
    return Engine(model, block_size=args.block_size, layout=args.layout, num_blocks=num_blocks,
                  max_num_seqs=len(args.prompt_list), enable_prefix_caching=True)


def prefill(engine: Engine, prompts: list[list[int]]) -> list[PrefixBlocks]:
    """Compute every prompt's KV; the cached prefix blocks of each (held until released)."""
    engine.generate(prompts, 1)
    return [export_prefix(engine, p) for p in prompts]


def receive(engine: Engine, exported: list[PrefixBlocks], read: Any) -> tuple[list[int], int, int, float]:
    """Reserve local blocks like ``exported``, fill them with ``read(group, remote_ids, local_ids)``, import them.

    Returns the blocks moved per KV cache group, the runs and bytes the reads
    moved, and the seconds from the first read's start to the last one's end.
    """
    local = [reserve_prefix(engine, e) for e in exported]
    blocks, runs, nbytes = [], 0, 0
    start = time.perf_counter()
    for g in range(len(exported[0].block_ids)):
        remote_ids = [b for e in exported for b in e.held_ids(g)]
        local_ids = [b for x in local for b in x.held_ids(g)]
        blocks.append(len(local_ids))
        if remote_ids:
            handle = read(g, remote_ids, local_ids)
            handle.wait(timeout=60)
            runs, nbytes = runs + handle.num_runs, nbytes + handle.nbytes
    seconds = time.perf_counter() - start
    for prefix in local:
        import_prefix(engine, prefix)
    return blocks, runs, nbytes, seconds


def prefill_process(args: argparse.Namespace, conn) -> None:
    engine = build_engine(args, args.prefill_blocks)
    with NixlAgent("prefill", engine.kv) as agent:
        exported = prefill(engine, args.prompt_list)
        conn.send((agent.metadata(), exported))
        conn.recv()  # the decode side has read every block: let them go (they stay cached here)
        for blocks in exported:
            release_prefix(engine, blocks)


def decode_process(args: argparse.Namespace, conn, results) -> None:
    engine = build_engine(args, args.decode_blocks)
    with NixlAgent("decode", engine.kv) as agent:  # after the cache: its CUDA context exists
        metadata, exported = conn.recv()
        peer = agent.connect(metadata)
        transport = agent.transport(peer)
        moved = receive(engine, exported, lambda g, remote, local: agent.read_blocks(peer, remote, local, group_id=g))
        conn.send("read")
    tokens = engine.generate(args.prompt_list, args.new_tokens)
    results.send((tokens, dict(engine.stats()), [e.num_tokens for e in exported], *moved,
                  f"{transport.name} ({transport.detail})"))


def one_process(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """The same prompts in one Engine, and through ``model.generate`` one prompt at a time."""
    engine = build_engine(args, args.prefill_blocks)
    served = engine.generate(args.prompt_list, args.new_tokens)
    expected = [
        engine.model.generate(torch.tensor([p], device=engine.device), max_new_tokens=args.new_tokens,
                              do_sample=False)[0, len(p):].tolist()
        for p in args.prompt_list
    ]
    return served, expected


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "gemma3"], help="random-weight HF model")
    p.add_argument("--layout", default="BLNHC", help="KV cache layout of both processes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where both engines run (default: cuda when present)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    for name in ("block_size", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = [int(n) for n in torch.randint(5, 70, (args.prompts,), generator=gen)]
    args.prompt_list = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    per_seq = 2 * -(-(max(lengths) + args.new_tokens) // args.block_size)  # two groups at most
    args.prefill_blocks = 1 + args.prompts * per_seq
    args.decode_blocks = 3 + 2 * args.prompts * per_seq  # room for the imported prefixes and the requests
    return args


def say(text: str) -> None:
    """Print ``text`` within the terminal's width (at most 80 columns), later lines indented."""
    width = min(shutil.get_terminal_size().columns, 80)
    print(textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    to_decode, from_prefill = ctx.Pipe()
    results_in, results_out = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=prefill_process, args=(args, to_decode)),
             ctx.Process(target=decode_process, args=(args, from_prefill, results_out))]
    for proc in procs:
        proc.daemon = True  # NOTE: ended with this process if a peer hangs
        proc.start()
    for end in (to_decode, from_prefill, results_out):
        end.close()  # the children hold them: a child's death then reads as EOF, not a hang
    served, expected = one_process(args)
    try:
        outcome = results_in.recv() if results_in.poll(300) else None
    except EOFError:
        outcome = None
    for proc in procs:
        proc.join(timeout=60)
    if outcome is None or any(proc.exitcode != 0 for proc in procs):
        print("a process failed: exit codes", [proc.exitcode for proc in procs])
        return 1
    tokens, stats, moved, blocks, runs, nbytes, seconds, transport = outcome
    prompt_tokens = sum(map(len, args.prompt_list))
    say(f"{args.arch}, layout {args.layout}, on {args.device}: the decode process read {sum(moved)} prompt "
        f"tokens' KV ({blocks} blocks per KV cache group, {nbytes} bytes in {runs} runs) through NIXL")
    say(f"transfer of the prompts' KV: {seconds * 1e3:.2f} ms ({nbytes / seconds / 1e9:.3f} GB/s, first "
        f"transfer included), transport {transport}")
    say(f"decode engine: computed {stats['prefill_tokens']} of {prompt_tokens} prompt tokens, "
        f"{stats['prefix_cache_hit_tokens']} came from its prefix cache ({stats['prefix_cache_hits']} hits)")
    for i, (got, want) in enumerate(zip(tokens, expected)):
        say(f"prompt {i} ({len(args.prompt_list[i])} tokens, {moved[i]} transferred): "
            f"{got}{'' if got == want else f'  != {want}'}")
    skipped = stats["prefix_cache_hit_tokens"] == sum(moved) and stats["prefill_tokens"] == prompt_tokens - sum(moved)
    same = tokens == expected == served
    say("tokens equal a one-process Engine.generate and model.generate" if same
        else "MISMATCH with the one-process run")
    if not skipped:
        say("the decode engine did not skip the transferred prompt tokens")
    return 0 if same and skipped else 1


if __name__ == "__main__":
    raise SystemExit(main())
