"""Serve an HF transformers model over tensor-parallel ranks with kvcore.hf.Engine.

transformers shards the weights with its own tensor-parallel plan (query/key/
value and MLP-up projections by columns, output and MLP-down projections by
rows, logits gathered); kvcore shards the KV cache to the heads each rank
computes (``shard_spec``) and makes every rank plan one block count in one
layout. Rank 0 then serves the same prompts in one process (unsharded model)
and compares the greedy tokens; both runs' output tokens/s are printed.

Run (CPU, gloo):   python -m torch.distributed.run --nproc-per-node 2 examples/tp_hf.py
Run (GPUs, NCCL):  torchrun --nproc-per-node 2 examples/tp_hf.py --dtype bfloat16
A checkpoint:      torchrun --nproc-per-node 2 examples/tp_hf.py --model DIR
Issue #19's ~1B Llama (bf16, tokens equal only in float32):
    torchrun --nproc-per-node 2 examples/tp_hf.py --dtype bfloat16 --hidden 2048 --layers 16 \
        --heads 32 --kv-heads 8 --vocab 32000 --num-prompts 256 --prompt-len 256 --max-new-tokens 128 \
        --max-num-seqs 256
Needs transformers and accelerate (transformers' tensor-parallel loader uses it).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# NOTE: without a GPU, Triton kernels run on CPU tensors through the interpreter,
# which must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import PreTrainedModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import ARCHITECTURES, load_model, model_config, random_model  # noqa: E402
from kvcore.hf.tp import load_tp_model, shard_model  # noqa: E402


def random_model_of(args: argparse.Namespace, dtype: torch.dtype) -> PreTrainedModel:
    """The same random-weight model on every rank (one seed), logits peaky so greedy ties cannot flip."""
    config = model_config(
        args.arch, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
    )
    return random_model(config, dtype=dtype, seed=args.seed)


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]


def timed_generate(engine: Engine, prompts: list[list[int]], n: int, device: torch.device,
                   group) -> tuple[list[list[int]], float]:
    """(tokens, output tokens/s) of one generate call, after a short warm-up."""
    engine.generate(prompts[:2], 2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group)
    start = time.perf_counter()
    tokens = engine.generate(prompts, n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return tokens, sum(map(len, tokens)) / elapsed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local checkpoint directory (default: a random-weight --arch)")
    p.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    p.add_argument("--backend", default="triton" if cuda else "torch", help="registered backend name")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=None, help="default: what the memory allows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the one-process run on rank 0")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:  # plain `python tp_hf.py`: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    dtype = getattr(torch, args.dtype)

    if args.model:
        model = load_tp_model(args.model, group=group, dtype=dtype)
        full = None
    else:
        full = random_model_of(args, dtype)
        model = shard_model(full, group)
    engine = Engine(model, backend=args.backend, max_num_seqs=args.max_num_seqs,
                    num_blocks=args.num_blocks, group=group)
    prompts = make_prompts(args, model.config.vocab_size)
    tokens, rate = timed_generate(engine, prompts, args.max_new_tokens, device, group)
    kv = engine.kv
    line = (f"rank {rank}/{world}: {next(iter(kv.layer_kv_caches.values())).shape[1]} KV heads per layer "
            f"in the cache, {kv.num_blocks} blocks, layout {kv.layout.name}")
    lines: list = [None] * world
    dist.all_gather_object(lines, line)
    ok = torch.ones(1, device=device)
    if rank == 0:
        print("\n".join(lines), flush=True)
        print(f"TP={world} ({dist.get_backend()}, {args.backend} backend, {args.dtype}): "
              f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {rate:,.1f} output tokens/s", flush=True)
        for i, toks in enumerate(tokens[:3]):
            print(f"  prompt {i}: {toks}", flush=True)
        if not args.no_check and world > 1:
            if full is None:
                full = load_model(args.model, dtype=dtype, device=str(device))
            full = full.to(device)
            single = Engine(full, backend=args.backend, max_num_seqs=args.max_num_seqs,
                            num_blocks=args.num_blocks)
            ref, ref_rate = timed_generate(single, prompts, args.max_new_tokens, device, None)
            same = ref == tokens
            print(f"TP=1 on rank 0: {ref_rate:,.1f} output tokens/s; TP={world}/TP=1 = {rate / ref_rate:.2f}x; "
                  f"tokens equal: {same}", flush=True)
            if not same and dtype == torch.float32:
                ok.zero_()
    dist.broadcast(ok, src=0)
    dist.barrier()
    dist.destroy_process_group()
    if ok.item() != 1:
        if rank == 0:
            print("FAIL: the tensor-parallel tokens differ from the one-process run", flush=True)
        return 1
    if rank == 0:
        print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
