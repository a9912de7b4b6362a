"""BlockPool: the null block, all-or-nothing allocation, validated frees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import BlockPool
from kvcore.errors import OutOfBlocksError


def _state(pool: BlockPool) -> tuple[int, list[bool]]:
    return pool.num_free_blocks, [pool.is_allocated(b) for b in range(pool.num_blocks)]


def test_null_block_is_never_handed_out():
    pool = BlockPool(8)
    ids = pool.allocate(7)
    assert sorted(ids) == list(range(1, 8))
    assert pool.num_free_blocks == 0
    assert not pool.is_allocated(0)


def test_out_of_blocks_reports_counts_and_allocates_nothing():
    pool = BlockPool(6)
    held = pool.allocate(3)
    before = _state(pool)
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate(3)
    assert (info.value.requested, info.value.free) == (3, 2)
    assert "3" in str(info.value) and "2" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert _state(pool) == before
    assert pool.take_new_blocks() == held


@pytest.mark.parametrize(
    "bad, match",
    [([0], "null block"), ([9], "outside"), ([-1], "outside"), ([4, 4], "appears twice")],
)
def test_bad_free_raises_and_leaves_pool_unchanged(bad, match):
    pool = BlockPool(9)
    held = pool.allocate(4)
    assert 4 in held
    before = _state(pool)
    with pytest.raises(ValueError, match=match):
        pool.free([held[0], *bad])
    assert _state(pool) == before


def test_double_free_across_calls():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    before = _state(pool)
    with pytest.raises(ValueError, match=f"block {ids[0]} is not allocated"):
        pool.free(ids)
    assert _state(pool) == before


def test_non_integer_ids_and_counts_are_type_errors():
    pool = BlockPool(4)
    with pytest.raises(TypeError):
        pool.allocate(1.5)
    with pytest.raises(TypeError):
        pool.free(["1"])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_take_new_blocks_reports_each_live_allocation_once():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.free(a[:1])  # freed before zeroing: not reported
    b = pool.allocate(3)  # reuses a[0] last (first-freed, first-reused order)
    assert b[-1] == a[0]
    new = pool.take_new_blocks()
    assert sorted(new) == sorted([a[1], *b]) and len(new) == 4
    assert pool.take_new_blocks() == []


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(2, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40),
)
def test_pool_invariants_under_random_traffic(num_blocks, ops):
    """Live ids are distinct, never 0, within range, and free + live = num_blocks - 1;
    take_new_blocks returns exactly the live ids not reported before."""
    pool = BlockPool(num_blocks)
    live: list[int] = []
    reported: set[int] = set()
    for is_alloc, n in ops:
        if is_alloc:
            if n > pool.num_free_blocks:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n)
                continue
            got = pool.allocate(n)
            assert len(got) == n
            live.extend(got)
            reported.difference_update(got)
        else:
            gone, live = live[: n % (len(live) + 1)], live[n % (len(live) + 1) :]
            pool.free(gone)
        assert len(set(live)) == len(live) and 0 not in live
        assert all(0 < b < num_blocks for b in live)
        assert pool.num_free_blocks + len(live) == num_blocks - 1
        new = pool.take_new_blocks()
        assert set(new) == set(live) - reported
        reported.update(new)
