"""Continuous batching: which requests run this step, with how many tokens, in which blocks; who is
preempted when the pool runs dry, and where a request starts with prefix caching."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvcore._validate import as_int
from kvcore.hf.checkpoints import StateCheckpoints
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.kv_cache import KVCache
from kvcore.runtime.prefix_hash import block_hashes, sliding_window_blocks
from kvcore.specs.attention import SlidingWindowSpec
from kvcore.specs.base import KVCacheSpec
from kvcore.specs.state import MambaSpec


@attrs.frozen
class GroupInfo:
    """One KV cache group as the engine serves it, worked out once from its spec."""

    block_size: int
    #: Tokens of the sliding window, None for full attention.
    sliding_window: int | None
    #: Blocks a prefix-cache hit needs (the window before the next token); None: all.
    window_blocks: int | None
    #: A state group: one block (the request's state slot) whatever its length.
    state: bool

    @classmethod
    def of(cls, spec: KVCacheSpec) -> GroupInfo:
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        blocks = None if window is None else sliding_window_blocks(window, spec.block_size)
        return cls(spec.block_size, window, blocks, isinstance(spec, MambaSpec))

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` ever holds in this group at once."""
        if self.state:
            return 1
        full = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, (self.sliding_window - 1 + max_chunk) // self.block_size + 2)


@attrs.define(eq=False)
class Request:
    """One prompt being served: its tokens (prompt, then generated) and its blocks per KV cache group.

    ``num_computed`` leading tokens have their K/V in the cache. Its block ids are the leading
    ``num_blocks[g]`` entries of its ``row`` of the scheduler's table of group ``g`` (row -1: not
    running; id 0, the null block, where a sliding window dropped a block).
    """

    req_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    num_computed: int = 0
    row: int = -1
    num_blocks: list[int] = attrs.field(factory=list)
    #: Chained hashes of the full blocks of ``tokens``, by block size (prefix caching only).
    block_hashes: dict[int, list[bytes]] = attrs.field(factory=dict)
    #: Per group: blocks already recorded in the prefix cache.
    num_cached_blocks: list[int] = attrs.field(factory=list)
    finished: bool = False
    #: A hybrid's state checkpoints: to restore into its slots, and to write this step (checkpoints.py).
    restore: dict[int, int] = attrs.field(factory=dict)
    checkpoints: list = attrs.field(factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_new_tokens(self) -> int:
        return len(self.tokens) - self.num_computed

    def reset(self, num_groups: int) -> None:
        """Forget every block (a new request, or a preempted one to be recomputed)."""
        self.num_blocks = [0] * num_groups
        self.num_cached_blocks = [0] * num_groups
        self.num_computed = 0
        self.row = -1


def check_prompt(index: int, prompt: Any, max_new_tokens: Any, *, vocab_size: int, max_model_len: int) -> list[int]:
    """``prompt`` as a list of ints, or ``ValueError``/``TypeError`` naming prompt ``index`` and the fix."""
    where = f"prompt {index}"
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{where} must be a list of token ids, got {type(prompt).__name__}; tokenize it first")
    tokens = [as_int(f"{where} token", t) for t in prompt]
    if not tokens:
        raise ValueError(f"{where} is empty; give at least one token id")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{where} holds token ids {sorted(set(bad))[:8]} outside the vocabulary 0..{vocab_size - 1}; "
            "use the model's own tokenizer"
        )
    new = as_int("max_new_tokens", max_new_tokens)
    if new < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {new}")
    if len(tokens) + new > max_model_len:
        raise ValueError(
            f"{where} has {len(tokens)} tokens; with max_new_tokens={new} it needs {len(tokens) + new} "
            f"positions but the model takes at most {max_model_len} (max_position_embeddings); "
            "shorten the prompt or lower max_new_tokens"
        )
    return tokens


class Scheduler:
    """Queues, admission and block bookkeeping (the one table per group) for one ``KVCache``."""

    def __init__(self, kv: KVCache, *, max_num_batched_tokens: int, state_checkpoint_tokens: int | None = None,
                 ) -> None:
        self.pool: BlockPool = kv.block_pool
        #: Prefix caching is on when the cache's pool caches blocks (``enable_prefix_caching``).
        self.prefix_caching = self.pool.enable_caching
        self.groups = [GroupInfo.of(g.kv_cache_spec) for g in kv.config.kv_cache_groups]
        #: Each group's pool: ``pool``, or the state pool of a separate state region.
        self.pools = [kv.pool_of(g) for g in range(len(self.groups))]
        self.max_num_seqs = kv.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        #: Counts by ``EngineStats`` field (the engine's too).
        self.counts: collections.Counter[str] = collections.Counter()
        #: ``grow(k)``: try to add at least ``k`` free blocks (an elastic cache); True when it did.
        self.grow: Callable[[int], bool] | None = None
        # NOTE: sized for an elastic cache's largest pool.
        self.tables = [np.zeros((kv.max_num_seqs, self._width(g, kv)), np.int32) for g in self.groups]
        self._free_rows = list(range(kv.max_num_seqs - 1, -1, -1))
        #: What a prefix hit matches per group: (tokens per hash, window); a state group's checkpoints.
        self.keys = [(g.block_size, g.window_blocks) for g in self.groups]
        self.checkpoints: StateCheckpoints | None = None
        states = [g for g, pool in enumerate(self.pools) if pool is not self.pool]
        if self.prefix_caching and states:
            for g in states:
                self.keys[g] = (state_checkpoint_tokens, 1)  # NOTE: one checkpoint at exactly that depth
            self.checkpoints = StateCheckpoints(kv.state_pool, states, state_checkpoint_tokens, self._hashes,
                                                kv.max_num_seqs)

    def _width(self, group: GroupInfo, kv: KVCache) -> int:
        # NOTE: a sliding-window request indexes block ``position // block_size`` up to the model's
        # length although it holds only the window's blocks.
        if group.state:
            return 1
        tokens = kv.max_model_len
        if group.sliding_window is None:
            tokens = min(tokens, kv.max_num_blocks * group.block_size)
        return -(-tokens // group.block_size)

    def blocks(self, request: Request, g: int) -> np.ndarray:
        """Group ``g``'s block ids of running ``request``: the used part of its row (a view)."""
        return self.tables[g][request.row, : request.num_blocks[g]]

    def peak_blocks(self, num_tokens: int) -> int:
        """Blocks of ``pool`` a request of ``num_tokens`` tokens may hold at once, over its groups."""
        return sum(g.peak_blocks(num_tokens, self.max_num_batched_tokens)
                   for g, pool in zip(self.groups, self.pools) if pool is self.pool)

    def add(self, request: Request) -> None:
        request.reset(len(self.groups))
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's requests and token counts: running ones (oldest first), then waiting ones while
        the budget, ``max_num_seqs`` and the blocks last; a dry pool preempts the newest running one."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        preemptions = self.counts["preemptions"]
        for request in list(self.running):
            if budget == 0 or request.row < 0:  # NOTE: row -1: preempted for an older request
                break
            n = min(request.num_new_tokens, budget)
            while request.row >= 0 and not self._grow(request, n):
                victim = self.running.pop()
                self._release(victim)
                self.waiting.appendleft(victim)
                self.counts["preemptions"] += 1
            if request.row < 0:
                break
            if self.checkpoints is not None:
                self.checkpoints.plan(request, n, len(self.running))
            batch.append((request, n))
            budget -= n
        preempted = self.counts["preemptions"] > preemptions
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            request.row = self._free_rows.pop()
            if self.prefix_caching:
                self._admit_cached(request)
            n = min(request.num_new_tokens, budget)
            if not self._grow(request, n):
                self._release(request)
                break
            self.waiting.popleft()
            self.running.append(request)
            if self.checkpoints is not None:
                self.checkpoints.plan(request, n, len(self.running))
            batch.append((request, n))
            budget -= n
        return batch

    def _grow(self, request: Request, n: int) -> bool:
        """Give ``request`` the blocks for ``n`` more tokens in every group, or none at all."""
        start = request.num_computed
        needs = []
        for g, info in enumerate(self.groups):
            if info.state:
                needs.append(0 if request.num_blocks[g] else 1)
                continue
            if info.sliding_window is not None:
                self._drop_out_of_window(request, g, start - info.sliding_window + 1)
            needs.append(-(-(start + n) // info.block_size) - request.num_blocks[g])
        for pool in dict.fromkeys(self.pools):
            short = sum(n for n, p in zip(needs, self.pools) if p is pool) - pool.num_free_blocks
            grow = self.grow if pool is self.pool else None  # NOTE: the state region never grows
            if short > 0 and (grow is None or not grow(short)):
                return False
        for g, need in enumerate(needs):
            if need > 0:
                held = request.num_blocks[g]
                self.tables[g][request.row, held : held + need] = self.pools[g].allocate(need)
                request.num_blocks[g] += need
                self.counts["blocks_allocated"] += need
        return True

    def _drop_out_of_window(self, request: Request, g: int, first_visible: int) -> None:
        """Free group ``g``'s blocks wholly before position ``first_visible``."""
        end = min(max(first_visible, 0) // self.groups[g].block_size, request.num_blocks[g])
        span = self.tables[g][request.row, :end]
        gone = span[span != 0].tolist()
        if gone:
            span[:] = 0
            self.pool.free(gone)
            self.counts["window_freed_blocks"] += len(gone)

    def _release(self, request: Request) -> None:
        """Free every block of ``request`` (last block first) and its row."""
        if self.checkpoints is not None:
            self.checkpoints.release(request)
        if request.row >= 0:
            for g, rows in enumerate(self.tables):
                self.pools[g].free([b for b in reversed(self.blocks(request, g).tolist()) if b])
                rows[request.row] = 0
            self._free_rows.append(request.row)
        request.reset(len(self.groups))

    def _hashes(self, request: Request, block_size: int, num_blocks: int) -> list[bytes]:
        """The first ``num_blocks`` chained hashes of ``request``'s tokens (kept on the request)."""
        hashes = request.block_hashes.setdefault(block_size, [])
        if len(hashes) < num_blocks:
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else None
            hashes.extend(block_hashes(request.tokens[start : num_blocks * block_size], block_size, parent=parent))
        return hashes[:num_blocks]

    def lookup(self, request: Request) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of ``request`` short of its last token that every group (each in
        its pool) hits, and its blocks per group (each gains a reference, which the caller holds)."""
        limit, tokens = request.num_tokens - 1, -1
        hashes = [self._hashes(request, size, limit // size) for size, _ in self.keys]
        while tokens != limit:  # NOTE: the pools answer in turn until they agree
            tokens = limit
            for pool in dict.fromkeys(self.pools):
                mine = {i: (hashes[i], *self.keys[i]) for i, p in enumerate(self.pools) if p is pool}
                limit = pool.find_common_prefix(mine, max_tokens=limit)
        ids: list[list[int]] = []
        for i, (size, window) in enumerate(self.keys):
            ids.append(self.pools[i].get_cached_blocks(hashes[i][: tokens // size], group_id=i, window=window))
            if len(ids[i]) * size != tokens:
                raise RuntimeError(f"group {i}: prefix cache returned {len(ids[i])} blocks for {tokens} tokens")
        return tokens, ids

    def _admit_cached(self, request: Request) -> None:
        """Start ``request`` at its longest cached prefix: shared blocks, no prefill for them."""
        tokens, hit = self.lookup(request)
        if tokens == 0:
            return
        for i, ids in enumerate(hit):
            if self.pools[i] is not self.pool:  # NOTE: a checkpoint, copied into the slot _grow gives
                request.restore[i] = ids[-1]
                continue
            self.tables[i][request.row, : len(ids)] = ids
            request.num_blocks[i] = request.num_cached_blocks[i] = len(ids)
        request.num_computed = tokens
        self.counts["prefix_cache_hits"] += 1
        self.counts["prefix_cache_hit_tokens"] += tokens

    def _cache_full_blocks(self, request: Request) -> None:
        """Record the blocks of ``request`` that the last step filled."""
        for i, g in enumerate(self.groups):
            full, done = request.num_computed // g.block_size, request.num_cached_blocks[i]
            if full <= done or self.pools[i] is not self.pool:
                continue
            hashes = self._hashes(request, g.block_size, full)[done:full]
            pairs = [(h, b) for h, b in zip(hashes, self.tables[i][request.row, done:full].tolist()) if b]
            self.pool.cache_blocks([h for h, _ in pairs], [b for _, b in pairs], group_id=i)
            request.num_cached_blocks[i] = full

    def finish_step(self, batch: list[tuple[Request, int]]) -> None:
        for request, n in batch:
            request.num_computed += n
            if self.prefix_caching:
                self._cache_full_blocks(request)
            if self.checkpoints is not None:
                self.checkpoints.cache(request)

    def abort_all(self) -> None:
        """Drop every queued request (running or waiting) and free all it holds."""
        for request in [*self.running, *self.waiting]:
            self._release(request)
        self.running.clear()
        self.waiting.clear()

    def finish(self, request: Request) -> None:
        request.finished = True
        self.running.remove(request)
        self._release(request)
