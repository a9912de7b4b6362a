"""Disaggregated serving: prefill in one process, decode in another, KV blocks moved by NIXL.

The prefill process runs every prompt through the model (the small GQA
transformer of examples/tiny_model.py) over its own paged KV cache and samples
each prompt's first token. It sends its NIXL metadata (which carries the KV
cache descriptor), each prompt's block table and first token to the decode
process over a local Pipe. The decode process connects, reads exactly the
prompts' blocks into blocks of its own cache (``NixlAgent.read_blocks``), and
finishes greedy generation. Its tokens equal a one-process run of the same
model, which this script also performs and compares.

Run: python examples/disaggregated.py [--layout BLNHC] [--prompts 3] [--new-tokens 8]
     [--block-size 16] [--dtype float32]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import ModelConfig, TinyTransformer  # noqa: E402

from kvcore import CommonAttentionMetadata, KVCache  # noqa: E402
from kvcore.transfer import NixlAgent  # noqa: E402

CONFIG = ModelConfig(vocab_size=256, hidden_size=128, num_layers=4, num_q_heads=4, num_kv_heads=2, head_size=32)


class PagedModel:
    """The model over one KV cache: batched steps with one block table per sequence."""

    def __init__(self, args: argparse.Namespace, num_blocks: int) -> None:
        dtype = getattr(torch, args.dtype)
        self.model = TinyTransformer(CONFIG, dtype=dtype, device=torch.device("cpu"), seed=args.seed)
        self.kv = KVCache.create(
            CONFIG.kv_cache_specs(args.block_size, dtype),
            dict.fromkeys(map(CONFIG.layer_name, range(CONFIG.num_layers)), "torch"), device="cpu", layout=args.layout, num_blocks=num_blocks, max_num_seqs=args.prompts, max_model_len=256,
        )
        self.block_size = self.kv.block_size(0)
        # NOTE: an untied output head: with the tied one, this random-weight model mostly repeats
        # its input token, which would make the tokens blind to the cached K/V.
        gen = torch.Generator().manual_seed(args.seed + 7)
        self.head = torch.randn(CONFIG.hidden_size, CONFIG.vocab_size, generator=gen)

    def allocate(self, num_tokens: int) -> list[int]:
        """A block table for ``num_tokens`` tokens (new blocks are zeroed by the next step)."""
        return self.kv.block_pool.allocate(-(-num_tokens // self.block_size))

    def step(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
        """Compute the K/V of each sequence's new tokens ``chunks[i]`` (from position ``starts[i]``); greedy next tokens."""
        self.kv.begin_step()
        size = self.block_size
        lens = [len(c) for c in chunks]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
        slots = table[rows, positions // size].to(torch.int64) * size + positions % size
        query_start = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start, seq_lens=seq_lens, block_table_tensor=table, slot_mapping=slots,
            num_reqs=len(chunks), num_actual_tokens=sum(lens), max_query_len=max(lens),
            max_seq_len=int(seq_lens.max()),
        )
        metadata = self.kv.build_metadata([common])

        def attend(index: int, q, k, v):
            name = CONFIG.layer_name(index)
            backend = self.kv.group_of(name).backend
            return backend.forward(q, k, v, self.kv.layer_kv_caches[name], metadata[name],
                                   head_size=CONFIG.head_size, scale=self.model.scale)

        tokens = torch.tensor([t for c in chunks for t in c])
        hidden = self.model.forward(tokens, positions, attend)
        return (hidden[query_start[1:].long() - 1].float() @ self.head).argmax(-1).tolist()

    def prefill(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Each prompt's block table and first generated token."""
        tables = [self.allocate(len(p)) for p in prompts]
        return tables, self.step(prompts, [0] * len(prompts), tables)

    def decode(self, prompts: list[list[int]], first: list[int], tables: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy decoding after the prompts' K/V are in the cache (``tables``, grown here as needed)."""
        outputs = [[t] for t in first]
        for _ in range(new_tokens - 1):
            lengths = [len(p) + len(o) - 1 for p, o in zip(prompts, outputs)]  # tokens already cached
            for table, n in zip(tables, lengths):
                missing = -(-(n + 1) // self.block_size) - len(table)
                if missing > 0:
                    table += self.kv.block_pool.allocate(missing)
            nxt = self.step([[o[-1]] for o in outputs], lengths, tables)
            for out, token in zip(outputs, nxt):
                out.append(token)
        return outputs


def prefill_process(args: argparse.Namespace, conn) -> None:
    runner = PagedModel(args, num_blocks=args.prefill_blocks)
    with NixlAgent("prefill", runner.kv) as agent:
        tables, first = runner.prefill(args.prompt_list)
        conn.send((agent.metadata(), tables, first))
        conn.recv()  # the decode side has read every block; our cache may go now


def decode_process(args: argparse.Namespace, conn, results) -> None:
    runner = PagedModel(args, num_blocks=args.decode_blocks)
    with NixlAgent("decode", runner.kv) as agent:
        metadata, remote_tables, first = conn.recv()
        peer = agent.connect(metadata)
        runner.allocate(2 * args.block_size)  # held by "other requests": our block ids differ from the prefill's
        tables = [runner.allocate(len(p)) for p in args.prompt_list]
        # NOTE: new blocks are zeroed by the next begin_step(); zero them now, before the
        # prompts' K/V arrive, or that step would wipe what NIXL wrote.
        runner.kv.begin_step()
        remote = [b for t in remote_tables for b in t]
        local = [b for t in tables for b in t]
        handle = agent.read_blocks(peer, remote, local)
        handle.wait(timeout=60)
        conn.send("read")
        results.send((runner.decode(args.prompt_list, first, tables, args.new_tokens), handle.num_runs, handle.nbytes))


def one_process(args: argparse.Namespace) -> list[list[int]]:
    runner = PagedModel(args, num_blocks=args.prefill_blocks)
    tables, first = runner.prefill(args.prompt_list)
    return runner.decode(args.prompt_list, first, tables, args.new_tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="BLNHC", help="KV cache layout of both processes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = [int(n) for n in torch.randint(5, 40, (args.prompts,), generator=gen)]
    args.prompt_list = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    per_seq = -(-(max(lengths) + args.new_tokens) // args.block_size)
    args.prefill_blocks = 1 + args.prompts * per_seq
    args.decode_blocks = 3 + args.prompts * per_seq  # a pool of another size
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = multiprocessing.get_context("spawn")
    to_decode, from_prefill = ctx.Pipe()
    results_in, results_out = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=prefill_process, args=(args, to_decode)),
             ctx.Process(target=decode_process, args=(args, from_prefill, results_out))]
    for proc in procs:
        proc.start()
    reference = one_process(args)
    outcome = results_in.recv() if results_in.poll(300) else None
    for proc in procs:
        proc.join(timeout=60)
    if outcome is None or any(proc.exitcode != 0 for proc in procs):
        print("a process failed: exit codes", [proc.exitcode for proc in procs])
        return 1
    tokens, runs, nbytes = outcome
    print(f"layout {args.layout}: decode read {nbytes} bytes of prompt KV in {runs} runs through NIXL")
    for i, (got, want) in enumerate(zip(tokens, reference)):
        print(f"prompt {i} ({len(args.prompt_list[i])} tokens): {got}{'' if got == want else f'  != {want}'}")
    same = tokens == reference
    print("tokens equal the one-process run" if same else "MISMATCH with the one-process run")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
