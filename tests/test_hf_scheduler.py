"""The engine's scheduler, driven without a model: block bookkeeping invariants hold at every step.

Invariants, checked after every ``schedule()`` for random workloads:
- a step computes at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs`` requests;
- every scheduled request holds blocks for all its tokens up to the end of its chunk, in every group,
  and a sliding-window group still holds every block a query of the chunk can see;
- each block is held as many times as the pool counts references (once without caching), only
  by running requests; a request's blocks are the leading entries of its row of the block
  tables the batch builder reads, and every other entry (past them, or in a free row) is 0;
- a sliding-window group never holds more blocks than ``peak_blocks`` allows;
- a state group (a hybrid's mixer states) gives every running request exactly one block, its slot;
- every request finishes (no deadlock) and all blocks come back to the pool, also when every
  queued request is aborted mid-way (as after a step that raised).
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from kvcore import FullAttentionSpec, KVCache, MambaSpec, SlidingWindowSpec  # noqa: E402
from kvcore.hf.scheduler import (
    Request,  # noqa: E402
    Scheduler,  # noqa: E402
)


def make_cache(num_blocks: int, window: int | None, state: bool = False, caching: bool = False) -> KVCache:
    """A cache of ``num_blocks`` for at most 3 requests at once."""
    full = FullAttentionSpec(4, 1, 8, torch.float32)
    specs = {"model.layers.0.self_attn": full}
    if window is not None:
        specs["model.layers.1.self_attn"] = SlidingWindowSpec(4, 1, 8, torch.float32, sliding_window=window)
    attention = list(specs)
    if state:
        specs["model.layers.2.mamba"] = MambaSpec(4, [(2, 4), (3, 2)], [torch.float32, torch.float32])
    return KVCache.create(specs, dict.fromkeys(attention, "torch"), device="cpu", num_blocks=num_blocks,
                          max_num_seqs=3, max_model_len=256, enable_prefix_caching=caching)


def check_invariants(sched: Scheduler, batch, budget: int) -> None:
    assert sum(n for _, n in batch) <= budget
    assert len(sched.running) <= sched.max_num_seqs
    holders: collections.Counter[int] = collections.Counter()
    for request in sched.running:
        for g, info in enumerate(sched.groups):
            table = sched.blocks(request, g).tolist()
            held = [b for b in table if b]
            holders.update(held)
            assert not sched.tables[g][request.row, len(table) :].any()
            if info.state:
                assert len(held) == len(table) == 1 and sched.tables[g].shape[1] == 1
            if info.sliding_window is not None:
                assert len(held) <= info.peak_blocks(request.num_tokens, sched.max_num_batched_tokens)
    assert not any(t[row].any() for t in sched.tables for row in sched._free_rows)
    for request, n in batch:
        end = request.num_computed + n
        for g, info in enumerate(sched.groups):
            table = sched.blocks(request, g).tolist()
            if info.state:
                continue
            assert len(table) * info.block_size >= end
            first = 0 if info.sliding_window is None else max(request.num_computed - info.sliding_window + 1, 0)
            assert all(table[first // info.block_size : -(-end // info.block_size)])
    pool = sched.pool
    for block_id, count in holders.items():
        assert pool.ref_count(block_id) == count
        assert count == 1 or pool.enable_caching
    assert pool.num_used_blocks == len(holders)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    data=st.data(),
    window=st.sampled_from([None, 5, 9]),
    num_blocks=st.integers(20, 40),
    budget=st.integers(1, 24),
    caching=st.booleans(),
    state=st.booleans(),
    abort_at=st.one_of(st.none(), st.integers(0, 20)),
)
def test_scheduler_keeps_blocks_consistent_and_finishes_everything(
    data, window, num_blocks, budget, caching, state, abort_at
):
    caching = caching and not state  # NOTE: the engine refuses prefix caching on a hybrid
    kv = make_cache(num_blocks, window, state, caching)
    sched = Scheduler(kv, max_num_batched_tokens=budget)
    assert sched.prefix_caching == caching
    lengths = data.draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10)), min_size=1, max_size=7))
    requests = []
    for i, (prompt_len, new) in enumerate(lengths):
        if sched.peak_blocks(prompt_len + new) > kv.num_blocks - 1:
            continue  # the engine refuses such a request up front
        # NOTE: a tiny alphabet makes shared prefixes (and cache hits) likely.
        prompt = data.draw(st.lists(st.integers(0, 1), min_size=prompt_len, max_size=prompt_len))
        requests.append(Request(i, prompt, prompt_len, new))
        sched.add(requests[-1])
    for step in range(2000):
        if not sched.has_work:
            break
        if step == abort_at:
            sched.abort_all()
            requests = []
            break
        batch = sched.schedule()
        assert batch, "nothing scheduled while requests wait: a deadlock"
        check_invariants(sched, batch, budget)
        kv.block_pool.take_new_blocks()  # what the engine's begin_step does before the step writes
        sched.finish_step(batch)
        for request, _ in batch:
            if request.num_computed == request.num_tokens:
                request.tokens.append(data.draw(st.integers(0, 1)))
                if len(request.tokens) - request.prompt_len >= request.max_new_tokens:
                    sched.finish(request)
    assert not sched.has_work
    assert all(r.finished and len(r.output) == r.max_new_tokens for r in requests)
    assert kv.block_pool.num_free_blocks == kv.num_blocks - 1
