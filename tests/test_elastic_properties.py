"""Random grow / shrink / allocate / free / write sequences on an elastic cache, against a model.

Invariants, in every layout and for uniform, hybrid (two groups), state
(Mamba) and split (kernel-block) caches, with prefix caching off and on:
- the bytes of every held block never change except by our writes;
- no view's address (``data_ptr``) ever changes;
- a shrink never cuts a held block: it is refused, and a refused call
  changes nothing (block count, committed bytes, free blocks);
- the pool, the zeroer's id range and the committed memory follow the size,
  and blocks handed out after a grow read as zero once the step begins.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from _elastic_caches import CASES, block_bytes, granules_touched, layer_groups, make_elastic, views_with_rows
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore import BlockPool
from kvcore.memory.elastic import block_byte_ranges

MAX_BLOCKS = 12


class ElasticCacheMachine(RuleBasedStateMachine):
    @initialize(case=st.sampled_from(CASES), start=st.integers(2, MAX_BLOCKS), caching=st.booleans())
    def build(self, case, start, caching):
        self.kv = make_elastic(*case, start, MAX_BLOCKS)
        if caching:
            self.kv.block_pool = BlockPool(self.kv.num_blocks, enable_caching=True)
        self.caching = caching
        self.groups = layer_groups(self.kv)
        self.ptrs = {n: v.data_ptr() for n, v in self.kv.kv_caches.items()}
        self.held: dict[int, dict[str, torch.Tensor]] = {}  # block -> layer -> expected bytes
        self.cached: dict[bytes, int] = {}  # hash -> block, for blocks freed after caching
        self.gen = torch.Generator().manual_seed(start)

    def _write(self, block: int) -> None:
        layers = self.groups[block % len(self.groups)]  # NOTE: groups overlay: a block belongs to one
        expected = {}
        for name in layers:
            live = block_bytes(self.kv, name, block)
            data = torch.randint(-128, 128, live.shape, dtype=torch.int8, generator=self.gen)
            live.copy_(data)
            expected[name] = data
        self.held[block] = expected

    def _state(self):
        kv = self.kv
        return kv.num_blocks, kv.committed_bytes, kv.block_pool.num_free_blocks, kv.zeroer.num_blocks

    @rule(k=st.integers(1, 4))
    def allocate(self, k):
        if k > self.kv.block_pool.num_free_blocks:
            return
        ids = self.kv.block_pool.allocate(k)
        zeroed = self.kv.begin_step()
        assert sorted(zeroed) == sorted(ids)
        for b in ids:
            for name in self.groups[b % len(self.groups)]:
                assert not block_bytes(self.kv, name, b).any()
            self._write(b)
        self.cached = {h: b for h, b in self.cached.items() if b not in ids}

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def write(self, data):
        self._write(data.draw(st.sampled_from(sorted(self.held))))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        block = data.draw(st.sampled_from(sorted(self.held)))
        if cache and self.caching:
            h = block.to_bytes(4, "little")
            self.kv.block_pool.cache_blocks([h], [block])
            self.cached[h] = block
        self.kv.block_pool.free([block])
        del self.held[block]

    @rule(n=st.integers(2, MAX_BLOCKS))
    def resize(self, n):
        before = self._state()
        cut = sorted(b for b in self.held if b >= n)
        if cut:
            with pytest.raises(ValueError, match=f"{len(cut)} block"):
                self.kv.resize(n)
            assert self._state() == before
            return
        self.kv.resize(n)
        assert self.kv.num_blocks == self.kv.block_pool.num_blocks == self.kv.zeroer.num_blocks == n
        for h, b in list(self.cached.items()):
            if b >= n:
                assert self.kv.block_pool.find_cached_prefix([h]) == 0
                del self.cached[h]

    @rule(n=st.one_of(st.integers(-3, 1), st.integers(MAX_BLOCKS + 1, MAX_BLOCKS + 5), st.just(4.0)))
    def refused_resize(self, n):
        before = self._state()
        with pytest.raises((ValueError, TypeError)):
            self.kv.resize(n)
        assert self._state() == before

    @invariant()
    def live_bytes_and_addresses_hold(self):
        if not hasattr(self, "kv"):
            return
        assert {n: v.data_ptr() for n, v in self.kv.kv_caches.items()} == self.ptrs
        for block, layers in self.held.items():
            for name, expected in layers.items():
                assert torch.equal(block_bytes(self.kv, name, block), expected), (block, name)
        granule = self.kv.elastic.backing.granularity
        want = granules_touched(block_byte_ranges(views_with_rows(self.kv), self.kv.num_blocks), granule)
        assert self.kv.committed_bytes == len(want) * granule


ElasticCacheMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=20, deadline=None, derandomize=True
)
test_elastic_cache_machine = ElasticCacheMachine.TestCase
