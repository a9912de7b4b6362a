"""A tiny continuous-batching engine over :class:`kvcore.KVCache`.

Each step: schedule decodes first, then prefill chunks within a token budget,
admitting waiting sequences while blocks last; grow every sequence's block
tables (one per KV cache group) from the shared pool and free blocks that
slid out of a window; zero the step's new blocks with ``KVCache.begin_step``;
run the model with the backend's paged attention, comparing every layer's
output with dense attention over the same tokens; sample greedily; free the
blocks of finished sequences.
"""

from __future__ import annotations

import collections
import math

import attrs
import torch
from tiny_model import TinyTransformer, dense_attention

from kvcore import CommonAttentionMetadata, KVCache, SlidingWindowSpec


@attrs.define(eq=False)
class Sequence:
    seq_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    block_tables: list[list[int]]  # one per KV cache group; 0 = null block
    lifetime_blocks: int  # blocks this sequence may need in all, over all groups
    num_computed: int = 0
    blocks_taken: int = 0
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


def kernel_rows(kv: KVCache, layer: str, block_ids: list[int]) -> torch.Tensor:
    """Rows of ``kv.layer_kv_caches[layer]`` (kernel blocks) making up the manager blocks."""
    group = kv.group_of(layer)
    ratio = group.blocks_per_manager_block
    ids = torch.tensor(block_ids, dtype=torch.int64)[:, None] * (group.kernel_block_stride or ratio)
    return (ids + torch.arange(ratio)).flatten().to(kv.device)


class Engine:
    """Greedy decoding for a batch of sequences, checked against dense attention.

    ``poison_freed`` fills freed blocks with NaN so that any block handed out
    again without zeroing shows up: ``check_zeroed`` verifies at every step
    that new blocks read as zero before the step writes them.
    """

    def __init__(
        self,
        model: TinyTransformer,
        kv: KVCache,
        backend: type,
        *,
        token_budget: int = 64,
        max_num_seqs: int = 8,
        check: bool = True,
        poison_freed: bool = True,
        check_zeroed: bool = True,
    ) -> None:
        self.model, self.kv, self.backend = model, kv, backend
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.check, self.poison_freed, self.check_zeroed = check, poison_freed, check_zeroed
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.windows = [
            g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
            for g in kv.config.kv_cache_groups
        ]
        self.max_abs_error = 0.0
        #: Layers whose backend returned an output without writing it into ``out=`` (checked runs).
        self.out_unwritten: set[str] = set()
        self.tokens_processed = 0
        self.ever_freed: set[int] = set()
        self.recycled_blocks = 0  # allocations of a block some sequence had freed
        self.window_freed_blocks = 0  # blocks freed because they slid out of a window

    def add_request(self, prompt: list[int], max_new_tokens: int) -> Sequence:
        total = len(prompt) + max_new_tokens
        if total > self.kv.max_model_len:
            raise ValueError(f"a sequence of {total} tokens exceeds max_model_len={self.kv.max_model_len}")
        lifetime = sum(-(-total // self.kv.block_size(g)) for g in range(self.kv.num_groups))
        if lifetime > self.kv.num_blocks - 1:
            raise ValueError(
                f"a sequence of {total} tokens needs {lifetime} blocks but the pool has "
                f"{self.kv.num_blocks - 1}; plan more blocks or shorten the request"
            )
        seq = Sequence(len(self.waiting) + len(self.running) + len(self.finished), list(prompt),
                       len(prompt), max_new_tokens, [[] for _ in range(self.kv.num_groups)], lifetime)
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.token_budget
        batch = []
        for seq in sorted(self.running, key=lambda s: len(s.tokens) - s.num_computed):
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if n:
                batch.append((seq, n))
                budget -= n
        # NOTE: admission reserves a sequence's whole lifetime, so growing a
        # running sequence never runs out of blocks (no preemption needed).
        reserved = sum(s.lifetime_blocks - s.blocks_taken for s in self.running)
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if reserved + seq.lifetime_blocks > self.kv.block_pool.num_free_blocks:
                break
            self.running.append(self.waiting.popleft())
            reserved += seq.lifetime_blocks
            batch.append((seq, min(seq.prompt_len, budget)))
            budget -= batch[-1][1]
        return batch

    def _grow(self, seq: Sequence, n: int) -> None:
        pool = self.kv.block_pool
        for g, table in enumerate(seq.block_tables):
            size, window = self.kv.block_size(g), self.windows[g]
            if window is not None:  # blocks no query of this step can see
                gone = [i for i, b in enumerate(table) if b and (i + 1) * size <= seq.num_computed - window + 1]
                self._free([table[i] for i in gone])
                self.window_freed_blocks += len(gone)
                for i in gone:
                    table[i] = 0
            new = pool.allocate(-(-(seq.num_computed + n) // size) - len(table))
            self.recycled_blocks += sum(b in self.ever_freed for b in new)
            seq.blocks_taken += len(new)
            table.extend(new)

    def _free(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        if self.poison_freed:
            for layer, view in self.kv.layer_kv_caches.items():
                view[kernel_rows(self.kv, layer, block_ids)] = float("nan")
        self.kv.block_pool.free(block_ids)
        self.ever_freed.update(block_ids)

    def _metadata(self, batch: list[tuple[Sequence, int]]) -> tuple[dict, torch.Tensor]:
        """Per-layer backend metadata (one block table per KV cache group) and positions."""
        dev = self.kv.device
        spans = [torch.arange(s.num_computed, s.num_computed + n) for s, n in batch]
        starts = torch.tensor([0] + [n for _, n in batch]).cumsum(0)
        seq_lens = torch.tensor([s.num_computed + n for s, n in batch])
        commons = []
        for g in range(self.kv.num_groups):
            size = self.kv.block_size(g)
            width = max(len(s.block_tables[g]) for s, _ in batch)
            table = torch.tensor([s.block_tables[g] + [0] * (width - len(s.block_tables[g])) for s, _ in batch])
            # slot = block id * block size + offset; kernel-block splitting keeps slots unchanged
            slots = torch.cat([table[i, pos // size] * size + pos % size for i, pos in enumerate(spans)])
            commons.append(
                CommonAttentionMetadata(
                    query_start_loc=starts.to(dev, torch.int32),
                    seq_lens=seq_lens.to(dev, torch.int32),
                    block_table_tensor=table.to(dev, torch.int32),
                    slot_mapping=slots.to(dev),
                    num_reqs=len(batch),
                    num_actual_tokens=int(starts[-1]),
                    max_query_len=max(n for _, n in batch),
                    max_seq_len=int(seq_lens.max()),
                )
            )
        return self.kv.build_metadata(commons), torch.cat(spans).to(dev)

    def step(self) -> int:
        """Run one engine step; returns the number of tokens it processed."""
        batch = self._schedule()
        if not batch:
            raise RuntimeError("nothing schedulable: the pool cannot hold the next waiting sequence")
        for seq, n in batch:
            self._grow(seq, n)
        new_blocks = self.kv.begin_step()
        if self.check_zeroed and new_blocks:
            for layer, view in self.kv.layer_kv_caches.items():
                if view[kernel_rows(self.kv, layer, new_blocks)].count_nonzero():
                    raise AssertionError(f"{layer}: newly allocated blocks were not zeroed")
        metadata, positions = self._metadata(batch)
        tokens = torch.tensor([t for s, n in batch for t in s.tokens[s.num_computed:s.num_computed + n]],
                              device=self.kv.device)
        hidden = self.model.forward(tokens, positions, lambda i, q, k, v: self._attend(i, q, k, v, batch, metadata))
        ends = torch.tensor([n for _, n in batch]).cumsum(0) - 1
        next_tokens = self.model.logits(hidden[ends.to(hidden.device)]).argmax(-1).tolist()
        for (seq, n), token in zip(batch, next_tokens):
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(token)
            if seq.finished:
                self.running.remove(seq)
                self.finished.append(seq)
                self._free([b for table in seq.block_tables for b in table if b])
                seq.history.clear()
        self.tokens_processed += len(tokens)
        return len(tokens)

    def _attend(self, index: int, q, k, v, batch, metadata) -> torch.Tensor:
        cfg, name = self.model.config, self.model.config.layer_name(index)
        window = cfg.window_of(index)
        # NOTE: a checked run hands forward a NaN-filled out=, which the backend must fill and return.
        buffer = q.new_full((*q.shape[:2], v.shape[-1]), math.nan) if self.check else None
        out = self.backend.forward(q, k, v, self.kv.layer_kv_caches[name], metadata[name],
                                   head_size=cfg.head_size, scale=self.model.scale, sliding_window=window, out=buffer)
        if self.check and not torch.equal(out, buffer):
            self.out_unwritten.add(name)
        if self.check:
            start = 0
            for seq, n in batch:
                old = seq.history.get(index)
                keys = k[start:start + n] if old is None else torch.cat([old[0], k[start:start + n]])
                values = v[start:start + n] if old is None else torch.cat([old[1], v[start:start + n]])
                seq.history[index] = (keys, values)
                ref = dense_attention(q[start:start + n], keys, values, scale=self.model.scale, sliding_window=window)
                err = (out[start:start + n].float() - ref).abs().max().item()
                self.max_abs_error = max(self.max_abs_error, math.inf if math.isnan(err) else err)
                start += n
        return out
