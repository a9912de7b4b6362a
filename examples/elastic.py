"""Two engines on one device take turns with the memory of an elastic KV cache.

Each ``kvcore.hf.Engine`` starts with a small cache (``--start-blocks``) and
address space for ``--max-blocks`` blocks. While one serves a burst of
requests its cache grows (instead of preempting); when ``generate`` returns
it shrinks back and the memory goes back to the system (CPU) or the device
(CUDA), ready for the other engine's burst. The timeline shows, at every
grow and after every burst, each engine's committed KV cache memory and the
memory held: the process's resident memory on a CPU (the models, activations and
Python too), the device's used memory (``torch.cuda.mem_get_info``) on a GPU.
The last lines give each cache's own peak growth.

Run: python examples/elastic.py [--device cpu|cuda] [--rounds 2] [--requests 8] [--prompt-len 200]
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _args import ArgumentParser, device_arg, run  # noqa: E402

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

MiB = 2**20


def held_bytes(device: torch.device) -> int:
    """Device memory in use (CUDA) or this process's resident memory (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def main(argv: list[str] | None = None) -> list[dict]:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--start-blocks", type=int, default=4)
    p.add_argument("--max-blocks", type=int, default=4096)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # NOTE: KV cache per token: 4 layers x 4 KV heads x 64 x (K, V) = 8 KiB in float32 on a CPU;
    # 8 layers x 8 heads x 128 = 32 KiB in bfloat16 on a GPU.
    small = device.type == "cpu"
    config = model_config("llama", hidden_size=256 if small else 1024, num_hidden_layers=4 if small else 8,
                          num_attention_heads=4 if small else 8, num_key_value_heads=4 if small else 8,
                          head_dim=64 if small else 128, max_position_embeddings=4096)
    # NOTE: backend classes, not names: no plugin entry point needs to be installed.
    if device.type == "cuda":
        from kvcore_triton.backend import TritonAttentionBackend as backend
    else:
        from kvcore_torch.backend import TorchAttentionBackend as backend
    engines = {
        name: Engine(random_model(config, dtype=dtype, device=device, seed=seed), backend=backend,
                     num_blocks=args.start_blocks, max_num_blocks=args.max_blocks, max_num_seqs=args.requests)
        for seed, name in enumerate("AB")
    }
    start, timeline = time.perf_counter(), []

    def record(event: str) -> None:
        row = {"t_s": time.perf_counter() - start, "event": event, "held": held_bytes(device),
               **{name: e.kv.committed_bytes for name, e in engines.items()}}
        timeline.append(row)
        print(f"{row['t_s']:6.1f}s  {event:21}" + "".join(
            f"  {name} {row[name] / MiB:6.1f} MiB" for name in engines) + f"  held {row['held'] / MiB:7.1f} MiB")

    for name, engine in engines.items():
        grow, finish = engine.scheduler.grow, engine.scheduler.finish

        def logged_grow(short: int, engine=engine, grow=grow, name=name) -> bool:
            grown = grow(short)
            record(f"{name} grows to {engine.kv.num_blocks}")
            return grown

        def logged_finish(request, engine=engine, finish=finish, name=name) -> None:
            if len(engine.scheduler.running) == args.requests:  # NOTE: the burst's peak, before blocks go
                record(f"{name} peak, {engine.kv.num_blocks} blocks")
            finish(request)

        engine.scheduler.grow, engine.scheduler.finish = logged_grow, logged_finish
    print(f"two engines on {device}, each from {args.start_blocks} to at most {args.max_blocks} blocks")
    record("start")
    gen = torch.Generator().manual_seed(0)
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            prompts = [torch.randint(3, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
                       for _ in range(args.requests)]
            engine.generate(prompts, args.max_new_tokens)
            record(f"{name} done (round {round_ + 1})")
    growth = {name: max(r[name] for r in timeline) - timeline[0][name] for name in engines}
    print("peak KV cache growth (committed): " + ", ".join(f"{n} {g / MiB:.1f} MiB" for n, g in growth.items()))
    print("preemptions: " + ", ".join(f"{n} {e.stats().preemptions}" for n, e in engines.items()))
    return timeline


if __name__ == "__main__":
    run(main, "elastic.py")
