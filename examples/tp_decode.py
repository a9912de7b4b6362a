"""The decode demo split over tensor-parallel ranks, checked against one process.

Every rank holds its shard of the query heads and KV heads (``kv_head_range``)
and a KV cache of its sharded specs (``shard_spec``); the attention output
projection and the MLP down projection are all-reduced. All ranks agree on one
block count and one layout, run the same deterministic scheduler, and rank 0
then repeats the run in one process with the unsharded model and compares
every step's logits and every generated token.

Run (CPU, gloo):   python -m torch.distributed.run --nproc-per-node 2 examples/tp_decode.py
Run (GPUs, NCCL):  torchrun --nproc-per-node 2 examples/tp_decode.py
Options: --tiny (fast smoke run), --backend torch|triton, --layout BLNHC, --num-kv-heads 2 ...

This one shards the home-made tiny model by hand and needs nothing beyond torch;
examples/tp_hf.py serves a real transformers architecture sharded by
transformers' own tensor-parallel plan.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

# NOTE: without a GPU, Triton kernels run on CPU tensors through the interpreter,
# which must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_engine import Engine  # noqa: E402
from tiny_model import ModelConfig, TinyTransformer  # noqa: E402

from kvcore import KVCache  # noqa: E402
from kvcore.distributed import agree_num_blocks, kv_head_range, shard_spec  # noqa: E402
from kvcore.plugins import get_backend  # noqa: E402

TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 2.5e-1}


class ShardedTransformer(TinyTransformer):
    """One rank's slice of a :class:`TinyTransformer` (Megatron-style).

    Query/KV projections are split by head (column-parallel), the output and
    MLP-down projections by input rows (row-parallel, then all-reduced); the
    embedding is replicated. Built by slicing the full model, which is fine
    for a demo; a real engine loads only its shard.
    """

    def __init__(self, full: TinyTransformer, rank: int, world: int) -> None:
        c = full.config
        if c.num_q_heads % world:
            raise ValueError(f"{c.num_q_heads} query heads cannot be split over {world} ranks")
        per_rank = c.num_q_heads // world
        q_heads = range(rank * per_rank, (rank + 1) * per_rank)
        kv_heads = kv_head_range(c.num_kv_heads, rank, world)
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.config = attrs.evolve(c, num_q_heads=len(q_heads), num_kv_heads=len(kv_heads))
        d, q_dim, kv_dim = c.head_size, c.num_q_heads * c.head_size, c.num_kv_heads * c.head_size

        def columns(heads: range, base: int) -> list[int]:
            return [base + h * d + i for h in heads for i in range(d)]

        q_cols = columns(q_heads, 0)
        qkv_cols = q_cols + columns(kv_heads, q_dim) + columns(kv_heads, q_dim + kv_dim)
        ffn = full.layers[0]["up"].shape[1] // world
        ffn_cols = list(range(rank * ffn, (rank + 1) * ffn))
        self.layers = [
            {
                "qkv": w["qkv"][:, qkv_cols].contiguous(),
                "out": w["out"][q_cols].contiguous(),
                "up": w["up"][:, ffn_cols].contiguous(),
                "down": w["down"][ffn_cols].contiguous(),
            }
            for w in full.layers
        ]
        self.embed, self.scale = full.embed, full.scale

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)  # row-parallel output and MLP-down projections
        return partial


class Recording:
    """Wraps a model and keeps every logits tensor the engine asks for."""

    def __init__(self, model) -> None:
        self.model, self.config, self.scale = model, model.config, model.scale
        self.logged: list[torch.Tensor] = []

    def forward(self, *args):
        return self.model.forward(*args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.model.logits(hidden)
        self.logged.append(out.detach().float().cpu())
        return out


def serve(model, kv: KVCache, backend, args: argparse.Namespace) -> tuple[dict, torch.Tensor, float]:
    """Serve the seeded requests to completion: (tokens per sequence, all logits, paged-vs-dense error)."""
    recording = Recording(model)
    kv.zeroer.warmup(kv.num_blocks)
    engine = Engine(recording, kv, backend, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs)
    gen = torch.Generator().manual_seed(args.seed)
    longest = 33 if args.tiny else 97
    for _ in range(args.num_seqs):
        prompt_len = int(torch.randint(8, longest, (), generator=gen))
        max_new = int(torch.randint(4, 9 if args.tiny else 25, (), generator=gen))
        prompt = torch.randint(model.config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, max_new)
    while engine.has_work:
        engine.step()
    tokens = {s.seq_id: s.tokens for s in engine.finished}
    return tokens, torch.cat(recording.logged), engine.max_abs_error


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_ranks() -> int:
    """Ranks on this host (torchrun sets LOCAL_WORLD_SIZE; a plain run is one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # NOTE: CUDA only with one GPU per local rank; fewer GPUs (two ranks on a one-GPU
    # machine) fall back to CPU tensors and gloo instead of asking for a missing device.
    cuda = _gpus() >= _local_ranks()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None,
                   help="registered backend name (default: triton on CUDA, torch on CPU)")
    p.add_argument("--layout", default=None, help="KV cache layout (default: what every rank prefers)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cpu", "cuda"],
                   help="cuda needs one GPU per rank on this host (default: cuda if so, else cpu with gloo)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-q-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2, help="fewer than the ranks: heads are replicated")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=40, help="rank r offers this + 2r blocks")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--token-budget", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="2 layers, 3 short sequences")
    args = p.parse_args(argv)
    if args.device == "cuda" and _gpus() < _local_ranks():
        p.error(f"--device cuda needs one GPU per rank: {_local_ranks()} ranks on this host but "
                f"{_gpus()} CUDA device(s); use --device cpu (gloo) or run fewer ranks")
    if args.backend is None:
        args.backend = "triton" if args.device == "cuda" else "torch"
    if args.tiny:
        args.num_seqs = min(args.num_seqs, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" not in os.environ:  # plain `python tp_decode.py`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and device.type == "cpu" and 0 < _gpus() < _local_ranks():
        print(f"note: {_local_ranks()} ranks on this host but {_gpus()} CUDA device(s): running on the CPU "
              "with gloo (one GPU per rank runs on CUDA with NCCL)", flush=True)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig(num_layers=2 if args.tiny else 4, num_q_heads=args.num_q_heads,
                         num_kv_heads=args.num_kv_heads)
    full = TinyTransformer(config, dtype=dtype, device=device, seed=args.seed)
    sharded = ShardedTransformer(full, rank, world)
    backend = get_backend(args.backend)
    full_specs = config.kv_cache_specs(args.block_size, dtype)
    specs = {name: shard_spec(spec, rank, world) for name, spec in full_specs.items()}

    # NOTE: each rank offers a different budget (as if its free memory differed);
    # the ranks must plan the smallest so one block table is valid everywhere.
    budget = args.num_blocks + 2 * rank
    num_blocks = agree_num_blocks(budget, dist.group.WORLD)
    kv = KVCache.create(specs, dict.fromkeys(specs, backend), device=device, layout=args.layout,
                        num_blocks=num_blocks, max_num_seqs=args.max_num_seqs, max_model_len=128,
                        group=dist.group.WORLD)
    spec = next(iter(specs.values()))
    line = (f"rank {rank}/{world}: query heads {list(sharded.q_heads)}, KV heads {list(sharded.kv_heads)} "
            f"of {config.num_kv_heads}; page {spec.page_size_bytes} of "
            f"{next(iter(full_specs.values())).page_size_bytes} bytes; offered {budget} blocks, "
            f"planned {kv.num_blocks}; layout {kv.layout.name}")
    lines = [None] * world
    dist.all_gather_object(lines, line)  # NOTE: rank 0 prints them in order, one per line
    if rank == 0:
        print("\n".join(lines), flush=True)

    tokens, logits, paged_err = serve(sharded, kv, backend, args)
    worst = torch.tensor([paged_err], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = torch.ones(1, device=device)
    if rank == 0:
        ref_kv = KVCache.create(full_specs, dict.fromkeys(full_specs, backend), device=device,
                                layout=kv.layout, num_blocks=kv.num_blocks,
                                max_num_seqs=args.max_num_seqs, max_model_len=128)
        ref_tokens, ref_logits, _ = serve(full, ref_kv, backend, args)
        same_tokens = tokens == ref_tokens
        err = (logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else float("inf")
        tol = TOLERANCE[dtype]
        generated = sum(len(t) for t in tokens.values()) - sum(len(t) for t in ref_tokens.values())
        print(f"{world} ranks ({dist.get_backend()}, {args.backend} backend, {dtype}): "
              f"{len(tokens)} sequences, {logits.shape[0]} logits rows; paged vs dense attention "
              f"max error {worst.item():.2e}", flush=True)
        print(f"max abs error vs single process: {err:.3e} (tolerance {tol:.0e}); "
              f"generated tokens equal: {same_tokens}", flush=True)
        if not (same_tokens and err <= tol and generated == 0):
            ok.zero_()
    dist.broadcast(ok, src=0)
    dist.barrier()
    dist.destroy_process_group()
    if ok.item() != 1:
        if rank == 0:
            print("FAIL: the tensor-parallel run differs from the single-process run", flush=True)
        return 1
    if rank == 0:
        print("OK: the tensor-parallel run matches the single-process run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
