"""BlockPool with prefix caching against a small reference model (hypothesis stateful testing).

In words: whatever the order of allocate / free / hit / cache / evict,
- every count (free, used, cached, evictable) and every block's reference count match the model;
- allocate hands out plain free blocks first-freed first, then evicts least recently freed first,
  and never a block someone holds;
- a hit returns exactly the model's longest cached prefix (sliding windows included);
- take_new_blocks reports exactly the blocks allocate handed out and nobody zeroed yet;
- refused calls (double free, bad cache_blocks) leave the pool exactly as it was.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcore import BlockPool
from kvcore.errors import OutOfBlocksError

HASHES = [b"h%d" % i for i in range(6)]


class PoolModel:
    """The pool's contract written the slow, obvious way (lists and dicts)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = {b: 0 for b in range(1, num_blocks)}
        self.plain = list(range(1, num_blocks))  # first out first
        self.evictable: list[int] = []  # least recently freed first
        self.cache: dict[tuple[int, bytes], int] = {}
        self.pending: set[int] = set()

    def key_of(self, block: int):
        return next((k for k, b in self.cache.items() if b == block), None)

    def allocate(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            if self.plain:
                ids.append(self.plain.pop(0))
            else:
                block = self.evictable.pop(0)
                del self.cache[self.key_of(block)]
                ids.append(block)
        for block in ids:
            self.refs[block] = 1
            self.pending.add(block)
        return ids

    def free(self, ids: list[int]) -> None:
        for block in ids:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.pending:
                    self.pending.discard(block)
                    key = self.key_of(block)
                    if key is not None:
                        del self.cache[key]
                (self.evictable if self.key_of(block) is not None else self.plain).append(block)

    def is_hit(self, group: int, hashes: list[bytes], window: int | None) -> bool:
        start = 0 if window is None else max(0, len(hashes) - window)
        return all((group, h) in self.cache for h in hashes[start:])

    def prefix(self, group: int, hashes: list[bytes], window: int | None) -> int:
        return max(n for n in range(len(hashes) + 1) if self.is_hit(group, hashes[:n], window))


class CachingPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 9))
    def start(self, num_blocks):
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.model = PoolModel(num_blocks)
        self.held: list[int] = []  # one entry per reference handed to a caller

    def snapshot(self):
        pool = self.pool
        blocks = range(1, pool.num_blocks)
        return (
            pool.num_free_blocks, pool.num_evictable_blocks, pool.num_cached_blocks,
            [pool.ref_count(b) for b in blocks], [pool.block_hash(b) for b in blocks],
        )  # fmt: skip

    def _allocate(self, n: int) -> list[int] | None:
        free = len(self.model.plain) + len(self.model.evictable)
        if n > free:
            before = self.snapshot()
            with pytest.raises(OutOfBlocksError) as info:
                self.pool.allocate(n)
            assert (info.value.requested, info.value.free) == (n, free)
            assert self.snapshot() == before
            return None
        got = self.pool.allocate(n)
        assert all(self.model.refs[b] == 0 for b in got), "handed out a block someone holds"
        assert got == self.model.allocate(n)
        self.held.extend(got)
        return got

    def _cache(self, hashes: list[bytes], ids: list[int], group: int) -> None:
        # The first refused block, in order: one still pending zeroing (no step was handed
        # it: caching it would lose its hash at free), or one cached under another key.
        for h, b in zip(hashes, ids):
            key = self.model.key_of(b)
            if b in self.model.pending:
                match = f"block {b} was allocated but no step has been handed it yet"
            elif key is not None and key != (group, h):
                match = f"block {b} is already cached under another hash"
            else:
                continue
            before = self.snapshot()
            with pytest.raises(ValueError, match=match):
                self.pool.cache_blocks(hashes, ids, group_id=group)
            assert self.snapshot() == before
            return
        self.pool.cache_blocks(hashes, ids, group_id=group)
        for h, b in zip(hashes, ids):
            self.model.cache.setdefault((group, h), b)

    def _hit(self, hashes: list[bytes], group: int, window: int | None) -> int:
        n = self.model.prefix(group, hashes, window)
        assert self.pool.find_cached_prefix(hashes, group_id=group, window=window) == n
        got = self.pool.get_cached_blocks(hashes, group_id=group, window=window)
        start = 0 if window is None else max(0, n - window)
        assert got == [0] * start + [self.model.cache[(group, h)] for h in hashes[start:n]]
        for block in got[start:]:
            if self.model.refs[block] == 0:
                self.model.evictable.remove(block)
            self.model.refs[block] += 1
            self.held.append(block)
        return n

    def _hashes(self, data, group: int) -> list[bytes]:
        cached = [h for g, h in self.model.cache if g == group]
        likely = st.sampled_from(cached) if cached else st.nothing()
        return data.draw(st.lists(likely | st.sampled_from(HASHES), max_size=5))

    @rule(n=st.integers(0, 9), zero=st.booleans())
    def allocate(self, n, zero):
        if self._allocate(n) is not None and zero:
            self.take_new()  # the engine's begin_step: zero new blocks before a step writes them

    @rule(data=st.data(), group=st.integers(0, 1), window=st.none() | st.integers(1, 3))
    def serve(self, data, group, window):
        """What an engine does for a request: hit its prefix, allocate and zero the rest, cache it."""
        hashes = self._hashes(data, group)
        n = self._hit(hashes, group, window)
        new = self._allocate(len(hashes) - n)
        if new is not None:
            self.take_new()
            self._cache(hashes[n:], new, group)

    @rule(data=st.data(), reverse=st.booleans())
    def free(self, data, reverse):
        if not self.held:
            return
        picks = data.draw(st.sets(st.integers(0, len(self.held) - 1), min_size=1))
        ids = [self.held[i] for i in sorted(picks)]
        if reverse:
            ids.reverse()
        self.held = [b for i, b in enumerate(self.held) if i not in picks]
        self.pool.free(ids)
        self.model.free(ids)

    @rule(data=st.data())
    def double_free(self, data):
        unheld = [b for b, r in self.model.refs.items() if r == 0]
        if not unheld:
            return
        block = data.draw(st.sampled_from(unheld))
        before = self.snapshot()
        with pytest.raises(ValueError, match=f"block {block} is not allocated"):
            self.pool.free(self.held[:1] + [block])
        assert self.snapshot() == before

    @rule(data=st.data(), group=st.integers(0, 1))
    def cache(self, data, group):
        live = sorted(set(self.held))
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=len(ids), max_size=len(ids)))
        self._cache(hashes, ids, group)

    @rule(data=st.data(), group=st.integers(0, 1), window=st.none() | st.integers(1, 3))
    def hit(self, data, group, window):
        self._hit(self._hashes(data, group), group, window)

    @rule(data=st.data(), window=st.none() | st.integers(1, 3), cap=st.none() | st.integers(0, 12))
    def common_prefix(self, data, window, cap):
        """Group 0: full attention, 2-token blocks; group 1: 4-token blocks, maybe a window."""
        full, other = self._hashes(data, 0), self._hashes(data, 1)
        groups = {0: (full, 2, None), 1: (other, 4, window)}
        top = min(2 * len(full), 4 * len(other), 99 if cap is None else cap)
        want = max(t for t in range(0, top + 1, 4)
                   if self.model.is_hit(0, full[: t // 2], None)
                   and self.model.is_hit(1, other[: t // 4], window))  # fmt: skip
        assert self.pool.find_common_prefix(groups, max_tokens=cap) == want

    @rule()
    def take_new(self):
        new = self.pool.take_new_blocks()
        assert len(new) == len(set(new)) and set(new) == self.model.pending
        self.model.pending.clear()

    @invariant()
    def matches_model(self):
        if not hasattr(self, "pool"):
            return
        pool, model = self.pool, self.model
        assert pool.num_free_blocks == len(model.plain) + len(model.evictable)
        assert pool.num_evictable_blocks == len(model.evictable)
        assert pool.num_used_blocks == sum(r > 0 for r in model.refs.values())
        assert pool.num_cached_blocks == len(model.cache)
        for block, refs in model.refs.items():
            assert pool.ref_count(block) == refs and pool.is_allocated(block) == (refs > 0)
            assert pool.block_hash(block) == model.key_of(block)
        assert sorted(self.held) == sorted(b for b, r in model.refs.items() for _ in range(r))


CachingPoolMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, derandomize=True
)
test_caching_pool_matches_model = CachingPoolMachine.TestCase


def test_a_block_freed_before_its_retried_zeroing_is_forgotten_by_the_cache():
    import random

    rng = random.Random(7)
    pool = BlockPool(8, enable_caching=True)
    ids = pool.allocate(3)
    assert pool.take_new_blocks() == ids
    hashes = [rng.randbytes(16) for _ in ids]
    pool.cache_blocks(hashes, ids)
    pool.requeue_new_blocks(ids[1:])  # zeroing failed for two of them: not written yet
    pool.free(ids)
    assert pool.num_cached_blocks == 1 and pool.block_hash(ids[0]) == (0, hashes[0])
    assert pool.find_cached_prefix(hashes) == 1  # the zeroed block still hits, the others do not
    assert pool.num_free_blocks == 7 and pool.take_new_blocks() == []
