"""BlockPool: the null block, all-or-nothing allocation, validated frees."""

from __future__ import annotations

import os

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


def test_free_accepts_one_id():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free(b)
    assert not pool.is_allocated(b) and pool.is_allocated(a)
    with pytest.raises(ValueError, match=f"block {b} is not allocated"):
        pool.free(b)
    with pytest.raises(TypeError):
        pool.free(1.0)


# --- prefix caching: behaviour a scheduler relies on, and each refusal -------------------------

H = [bytes([i]) * 16 for i in range(1, 8)]


def _caching_state(pool: BlockPool):
    blocks = range(1, pool.num_blocks)
    return (
        pool.num_free_blocks, pool.num_evictable_blocks, pool.num_cached_blocks,
        [pool.ref_count(b) for b in blocks], [pool.block_hash(b) for b in blocks],
    )  # fmt: skip


def _cached_pool(num_blocks: int = 8, n: int = 3) -> tuple[BlockPool, list[int]]:
    """A caching pool holding ``n`` written blocks cached under ``H[:n]``."""
    pool = BlockPool(num_blocks, enable_caching=True)
    ids = pool.allocate(n)
    assert pool.take_new_blocks() == ids  # zeroed, then a step writes them
    pool.cache_blocks(H[:n], ids)
    return pool, ids


def test_hit_shares_blocks_and_is_never_reported_as_new():
    pool, ids = _cached_pool()
    assert pool.get_cached_blocks(H[:2] + [b"x" * 16, H[2]]) == ids[:2]
    assert [pool.ref_count(b) for b in ids] == [2, 2, 1]
    assert pool.take_new_blocks() == []
    pool.free(ids)  # the first holder is done; the second still holds two blocks
    assert [pool.ref_count(b) for b in ids] == [1, 1, 0]
    assert pool.num_evictable_blocks == 1 and pool.num_free_blocks == 8 - 1 - 2


def test_freed_cached_blocks_stay_until_plain_blocks_run_out_then_go_least_recently_freed_first():
    pool, ids = _cached_pool(num_blocks=6, n=3)
    pool.free(ids[::-1])  # tail first: the tail is evicted first
    assert pool.num_free_blocks == 5 and pool.num_evictable_blocks == 3
    plain = pool.allocate(2)
    assert not set(plain) & set(ids) and pool.find_cached_prefix(H[:3]) == 3
    assert pool.allocate(1) == [ids[2]]
    assert pool.find_cached_prefix(H[:3]) == 2  # H[2] evicted
    assert pool.block_hash(ids[2]) is None
    assert pool.take_new_blocks() == [*plain, ids[2]]  # the evicted block counts as new


def test_groups_keep_their_own_caches():
    pool, ids = _cached_pool(n=2)
    assert pool.find_cached_prefix(H[:2], group_id=1) == 0
    other = pool.allocate(2)
    pool.take_new_blocks()
    pool.cache_blocks(H[:2], other, group_id=1)
    assert pool.get_cached_blocks(H[:2], group_id=1) == other
    assert pool.get_cached_blocks(H[:2], group_id=0) == ids


def test_sliding_window_hit_needs_only_the_blocks_in_the_window():
    pool, ids = _cached_pool(n=5)
    pool.free(ids[::-1])
    pool.allocate(2)  # plain blocks first: nothing evicted yet
    pool.allocate(2)  # evicts ids[4], then ids[3]
    assert pool.find_cached_prefix(H[:5]) == 3
    for evicted in ids[3:]:
        assert pool.block_hash(evicted) is None
    # the window of 2 blocks before the end of H[:3] is cached: a hit of 3 blocks
    assert pool.get_cached_blocks(H[:3], window=2) == [0, ids[1], ids[2]]
    assert pool.ref_count(ids[0]) == 0 and pool.ref_count(ids[1]) == 1
    with pytest.raises(ValueError, match="null block"):
        pool.free([0])


def test_identical_content_cached_twice_keeps_the_first_block():
    pool, ids = _cached_pool(n=1)
    twin = pool.allocate(1)
    pool.take_new_blocks()
    pool.cache_blocks(H[:1], twin)  # two requests computed the same block at once
    assert pool.block_hash(twin[0]) is None and pool.get_cached_blocks(H[:1]) == ids
    pool.cache_blocks(H[:1], ids)  # re-caching the same block is a no-op
    assert pool.block_hash(ids[0]) == (0, H[0])


def test_a_block_no_step_was_handed_cannot_be_cached():
    """Still pending zeroing: caching it is refused (it used to be dropped silently at free)."""
    pool = BlockPool(4, enable_caching=True)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match=f"block {ids[0]} was allocated but no step has been handed it yet"):
        pool.cache_blocks(H[:2], ids)
    assert pool.num_cached_blocks == 0 and pool.find_cached_prefix(H[:1]) == 0
    assert sorted(pool.take_new_blocks()) == sorted(ids)  # still pending, reported once
    pool.cache_blocks(H[:2], ids)
    pool.free(ids[::-1])
    assert pool.num_evictable_blocks == 2 and pool.find_cached_prefix(H[:2]) == 2


@pytest.mark.parametrize(
    "hashes, ids, match",
    [
        (H[:2], "ids3", "2 hashes for 3 block ids"),
        (H[:3], "ids2", "3 hashes for 2 block ids"),
        (H[:2], "twice", "block id twice"),
        (H[:1], [7], "block 7 is not allocated"),
        (H[:1], [0], "null block"),
        (H[:1], [9], "outside"),
        (["ab"], "ids1", r"hashes\[0\] must be non-empty bytes"),
        ([b""], "ids1", r"hashes\[0\] must be non-empty bytes"),
        (H[3:4], "cached0", "already cached under another hash"),
    ],
)
def test_bad_cache_blocks_raise_and_leave_the_pool_unchanged(hashes, ids, match):
    pool, cached = _cached_pool(num_blocks=9, n=2)
    fresh = pool.allocate(3)
    ids = {"ids3": fresh, "ids2": fresh[:2], "ids1": fresh[:1], "twice": [fresh[0]] * 2,
           "cached0": cached[:1]}.get(ids, ids) if isinstance(ids, str) else ids  # fmt: skip
    before = _caching_state(pool)
    with pytest.raises((ValueError, TypeError), match=match):
        pool.cache_blocks(hashes, ids)
    assert _caching_state(pool) == before


def test_cache_blocks_in_another_group_is_refused():
    pool, ids = _cached_pool(n=1)
    before = _caching_state(pool)
    with pytest.raises(ValueError, match=r"already cached under another hash \(group 0\)"):
        pool.cache_blocks(H[:1], ids, group_id=1)
    assert _caching_state(pool) == before


def test_bad_lookups_are_refused():
    pool, _ = _cached_pool()
    with pytest.raises(TypeError, match="not one value"):
        pool.get_cached_blocks(H[0])
    with pytest.raises(TypeError, match=r"hashes\[1\]"):
        pool.get_cached_blocks([H[0], 5])
    with pytest.raises(ValueError, match="group_id"):
        pool.find_cached_prefix(H[:1], group_id=-1)
    with pytest.raises(ValueError, match="window"):
        pool.get_cached_blocks(H[:1], window=0)
    with pytest.raises(TypeError, match="enable_caching"):
        BlockPool(4, enable_caching="yes")


def test_repeated_frees_of_a_shared_block_drop_one_reference_each():
    pool, ids = _cached_pool(n=1)
    pool.get_cached_blocks(H[:1])
    before = _caching_state(pool)
    with pytest.raises(ValueError, match=f"block {ids[0]} appears 3 times .* only 2 reference"):
        pool.free(ids * 3)
    assert _caching_state(pool) == before
    pool.free(ids * 2)
    assert pool.ref_count(ids[0]) == 0 and pool.num_evictable_blocks == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(ids)


def test_caching_off_keeps_todays_behaviour():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    assert pool.find_cached_prefix(H[:1]) == 0 and pool.get_cached_blocks(H[:1]) == []
    with pytest.raises(ValueError, match="enable_caching=True"):
        pool.cache_blocks(H[:1], ids[:1])
    pool.free(ids)
    assert pool.allocate(3) == [3, *ids]  # first freed, first reused; nothing kept


def test_common_prefix_of_a_hybrid_model_agrees_across_groups():
    """Full attention (4-token blocks) and a sliding window (2-token blocks, 1-block window)."""
    pool = BlockPool(16, enable_caching=True)
    full = [b"A%d" % i for i in range(3)]
    window = [b"B%d" % i for i in range(6)]
    a, b = pool.allocate(2), pool.allocate(5)
    pool.take_new_blocks()
    pool.cache_blocks(full[:2], a, group_id=0)  # full hits 8 tokens
    pool.cache_blocks([window[i] for i in (0, 1, 2, 4, 5)], b, group_id=1)  # B3 missing
    groups = {0: (full, 4, None), 1: (window, 2, 1)}
    # the window alone would hit 12 tokens, then 6 under the full group's 8; 6 is no full
    # block of group 0, so both settle on 4 tokens
    assert pool.find_cached_prefix(window, group_id=1, window=1) == 6
    assert pool.find_common_prefix(groups) == 4
    assert pool.find_common_prefix(groups, max_tokens=3) == 0
    assert pool.find_common_prefix({0: (full, 4, None)}) == 8
    assert pool.find_common_prefix({}) == 0
    assert pool.get_cached_blocks(window[:2], group_id=1, window=1) == [0, b[1]]
    with pytest.raises(ValueError, match="block_size"):
        pool.find_common_prefix({0: (full, 0, None)})
    with pytest.raises(TypeError, match=r"groups\[1\] must be \(hashes, block_size, window\)"):
        pool.find_common_prefix({0: (full, 4, None), 1: (window, 2)})


def test_a_tensor_group_id_looks_up_the_same_cache_as_the_int():
    torch = pytest.importorskip("torch")
    hashes = [os.urandom(16) for _ in range(3)]
    pool = BlockPool(8, enable_caching=True)
    pool.allocate(1)
    ids = pool.allocate(3)
    pool.take_new_blocks()
    pool.cache_blocks(hashes, ids, group_id=1)
    assert pool.find_cached_prefix(hashes, group_id=torch.tensor(1)) == 3
    assert pool.get_cached_blocks(hashes, group_id=torch.tensor(1)) == ids
    assert pool.get_cached_blocks(hashes, group_id=1) == ids
    assert [pool.ref_count(b) for b in ids] == [3, 3, 3]


@pytest.mark.parametrize("caching", [False, True])
def test_enable_caching_is_fixed_when_the_pool_is_built(caching):
    pool = BlockPool(4, enable_caching=caching)
    with pytest.raises(AttributeError):
        pool.enable_caching = not caching
    assert pool.enable_caching is caching
