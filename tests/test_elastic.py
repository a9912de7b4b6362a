"""Elastic KV caches on the CPU: what is committed, resize's refusals, and resident memory.

The committed ranges are checked byte by byte against the views of a plain
cache of the same plan: every byte a view of a block below ``n`` addresses is
committed, no byte of a block at or above ``n`` is.
"""

from __future__ import annotations

import mmap
import sys

import hypothesis.strategies as st
import pytest
import torch
from _elastic_caches import CASES, block_bytes, granules_touched, layer_groups, make_elastic, views_with_rows
from hypothesis import given, settings

from kvcore import BlockPool
from kvcore.errors import KVCoreError
from kvcore.memory.backing import CpuBacking
from kvcore.memory.elastic import block_byte_ranges, merge_ranges, subtract_ranges
from kvcore.transfer import describe, plan_transfer


def _mask(kv, ids: list[int]) -> torch.Tensor:
    """Bytes of the allocation that any view addresses for ``ids`` (brute force over a plain cache)."""
    view = next(iter(kv.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    raw.zero_()
    for name in kv.kv_caches:
        for b in ids:
            block_bytes(kv, name, b).fill_(-1)
    return raw != 0


@pytest.mark.parametrize("kind, layout", CASES)
def test_committed_ranges_cover_exactly_the_blocks_below_n(kind, layout):
    plain = make_elastic(kind, layout, 7, None)
    for n in range(2, 8):
        covered = torch.zeros(plain.config.kv_cache_tensors[0].size, dtype=torch.bool)
        for start, end in block_byte_ranges(views_with_rows(plain), n):
            covered[start:end] = True
        assert covered[_mask(plain, list(range(n)))].all(), n
        if n < 7:
            assert not covered[_mask(plain, list(range(n, 7)))].any(), n


@pytest.mark.parametrize("kind, layout", CASES)
def test_an_elastic_cache_has_the_views_of_max_num_blocks(kind, layout):
    plain, elastic = make_elastic(kind, layout, 7, None), make_elastic(kind, layout, 3, 7)
    assert (elastic.num_blocks, elastic.max_num_blocks, elastic.block_pool.num_blocks) == (3, 7, 3)
    assert elastic.config == plain.config
    for name, view in plain.kv_caches.items():
        other = elastic.kv_caches[name]
        assert (other.shape, other.stride()) == (view.shape, view.stride())
        assert other.storage_offset() == view.storage_offset()
    page = mmap.PAGESIZE
    want = len(granules_touched(block_byte_ranges(views_with_rows(elastic), 3), page)) * page
    assert elastic.committed_bytes == want < plain.committed_bytes


def test_resize_refuses_bad_input_and_changes_nothing():
    kv = make_elastic("uniform", "BLNHC", 4, 10)
    held = kv.block_pool.allocate(3)
    state = (kv.num_blocks, kv.committed_bytes, kv.block_pool.num_free_blocks, kv.zeroer.num_blocks)
    for bad, error, words in [(1, ValueError, "between 2"), (11, ValueError, "max_num_blocks=10"),
                              (3.0, TypeError, "integer"), (True, TypeError, "bool"), ("5", TypeError, "integer"),
                              (3, ValueError, "3 are held")]:  # fmt: skip
        with pytest.raises(error, match=words):
            kv.resize(bad)
        assert (kv.num_blocks, kv.committed_bytes, kv.block_pool.num_free_blocks, kv.zeroer.num_blocks) == state
    assert held == [1, 2, 3]
    plain = make_elastic("uniform", "BLNHC", 4, None)
    with pytest.raises(ValueError, match="max_num_blocks"):
        plain.resize(3)
    assert plain.max_num_blocks == plain.num_blocks == 4


@pytest.mark.parametrize("num_blocks, max_num_blocks, words", [(11, 10, "between 2 and max_num_blocks=10"),
                                                              (4, 1, "at least 2"), (4, 2.5, "integer")])
def test_create_refuses_bad_sizes(num_blocks, max_num_blocks, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make_elastic("uniform", "LBNHC", num_blocks, max_num_blocks)


def test_available_memory_commits_what_it_buys_up_to_max():
    plain = make_elastic("uniform", "BLNHC", 4, None)
    per_block = plain.config.kv_cache_tensors[0].size // 4
    assert make_elastic("uniform", "BLNHC", None, 50, available_memory=per_block * 9).num_blocks == 9
    assert make_elastic("uniform", "BLNHC", None, 6, available_memory=per_block * 9).num_blocks == 6


def test_shrink_evicts_cached_blocks_above_and_grow_hands_out_zeroed_blocks():
    kv = make_elastic("uniform", "LBNHC", 6, 12)
    kv.block_pool = BlockPool(kv.num_blocks, enable_caching=True)
    ids = kv.block_pool.allocate(5)
    kv.begin_step()
    for b in ids:
        for name in kv.kv_caches:
            block_bytes(kv, name, b).fill_(7)
    kv.block_pool.cache_blocks([b"low", b"high"], [1, 5])
    kv.block_pool.free(ids)
    kv.resize(3)
    assert kv.block_pool.find_cached_prefix([b"low"]) == 1 and kv.block_pool.find_cached_prefix([b"high"]) == 0
    kv.resize(12)
    new = kv.block_pool.allocate(kv.block_pool.num_free_blocks)
    assert max(new) == 11 and 5 in new
    kv.begin_step()
    for b in new:
        for name in kv.kv_caches:
            assert not block_bytes(kv, name, b).any()


def test_descriptor_follows_the_current_size():
    kv = make_elastic("hybrid", "BLNHC", 4, 9)
    kv.resize(6)
    descriptor = describe(kv)
    assert descriptor.num_blocks == 6
    assert plan_transfer(descriptor, [5])
    with pytest.raises(ValueError, match="6"):
        plan_transfer(descriptor, [6])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_shrink_gives_resident_memory_back():
    kv = make_elastic("uniform", "LBNHC", 2, 40_000)  # 3 KiB blocks x 40,000: 117 MiB reserved
    kv.resize(12_000)  # 35 MiB
    ids = kv.block_pool.allocate(11_999)
    for name in layer_groups(kv)[0]:
        kv.kv_caches[name][:12_000].view(torch.int8).fill_(3)
    before = _resident_bytes()
    kv.block_pool.free(ids)
    committed = kv.committed_bytes
    kv.resize(2)
    released = committed - kv.committed_bytes
    assert released > 30 * 2**20
    assert before - _resident_bytes() > 0.9 * released


def test_cpu_backing_releases_granules_that_read_as_zero():
    backing = CpuBacking(3 * 2**20, granularity=2**20)
    assert backing.size == 3 * 2**20 and backing.tensor.numel() == 3 * 2**20
    backing.commit(0, 2 * 2**20)
    backing.tensor[: 2 * 2**20].fill_(5)
    backing.decommit(2**20, 2 * 2**20)
    assert (backing.tensor[: 2**20] == 5).all() and not backing.tensor[2**20 : 2 * 2**20].any()
    with pytest.raises(ValueError, match="granule"):
        backing.commit(10, 2**20)
    with pytest.raises(ValueError, match="multiple"):
        CpuBacking(2**20, granularity=1000)


def test_missing_cuda_bindings_is_a_clear_error(monkeypatch):
    from kvcore.memory import backing_cuda

    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(KVCoreError, match=r"kvcore\[elastic\]"):
        backing_cuda.driver_module()


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), max_size=6),
       st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), max_size=6))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_range_arithmetic_matches_sets(a, b):
    a = merge_ranges((s, s + n) for s, n in a)
    b = merge_ranges((s, s + n) for s, n in b)
    as_set = lambda rs: {x for s, e in rs for x in range(s, e)}  # noqa: E731
    assert as_set(subtract_ranges(a, b)) == as_set(a) - as_set(b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 8), st.permutations(range(4)),
                          st.integers(0, 64), st.integers(1, 2)), min_size=1, max_size=3),
       st.integers(1, 4), st.sampled_from([1, 2, 8, 64, 512]))
def test_rounding_to_granules_covers_exactly_the_granules_blocks_touch(layers, n, g):
    views = {}
    for i, (heads, rows_n, c, order, offset, rows) in enumerate(layers):
        shape = (rows * 4, heads, rows_n, c)  # 4 manager blocks of `rows` rows each
        laid = [shape[d] for d in order]
        dense = torch.empty(offset + torch.Size(laid).numel(), dtype=torch.float16)[offset:].view(laid)
        views[f"l{i}"] = (dense.permute([order.index(d) for d in range(4)]), rows)
    exact = block_byte_ranges(views, n)
    rounded = block_byte_ranges(views, n, g)
    assert rounded == merge_ranges(rounded) and all(s % g == 0 and e % g == 0 for s, e in rounded)
    assert {x for s, e in rounded for x in range(s // g, e // g)} == granules_touched(exact, g)


def test_a_grow_that_runs_out_of_memory_changes_nothing(monkeypatch):
    from kvcore.memory import budget

    kv = make_elastic("uniform", "LHBNC", 2, 4000)  # LHBNC: one run per layer and head, so many ranges
    kv.block_pool.allocate(1)
    state = (kv.num_blocks, kv.committed_bytes, kv.block_pool.num_free_blocks, kv.zeroer.num_blocks)
    calls = []
    monkeypatch.setattr(budget, "available_host_memory",
                        lambda: 0 if calls.append(1) or len(calls) > 3 else None)
    with pytest.raises(KVCoreError, match="cannot commit"):
        kv.resize(3000)
    assert len(calls) == 4  # three ranges committed, then given back
    assert (kv.num_blocks, kv.committed_bytes, kv.block_pool.num_free_blocks, kv.zeroer.num_blocks) == state
    monkeypatch.setattr(budget, "available_host_memory", lambda: None)
    kv.resize(3000)
    assert kv.block_pool.num_free_blocks == 2998


def test_block_pool_resize_checks_its_argument_and_appends_new_ids():
    pool = BlockPool(4)
    assert pool.allocate(3) == [1, 2, 3]
    pool.resize(6)
    assert pool.allocate(2) == [4, 5] and pool.num_blocks == 6
    with pytest.raises(TypeError, match="integer"):
        pool.resize(5.0)
    with pytest.raises(ValueError, match="at least 2"):
        pool.resize(1)
    pool.free([5, 4])
    pool.resize(5)
    assert pool.num_free_blocks == 1 and pool.allocate(1) == [4] and not pool.is_allocated(5)
    with pytest.raises(ValueError, match="outside this pool"):
        pool.free([5])


def test_nixl_registration_and_host_pool_made_before_a_grow_move_new_blocks():
    from kvcore.transfer import HostKVPool, KVCacheDescriptor, NixlAgent, NixlUnavailableError

    a, b = make_elastic("hybrid", "BLNHC", 4, 16), make_elastic("hybrid", "BLNHC", 4, 16)
    try:
        agent_a, agent_b = NixlAgent("elastic-a", a), NixlAgent("elastic-b", b)  # registered at 4 blocks
    except NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    a.resize(16)
    b.resize(16)
    agent_a.descriptor, agent_b.descriptor = describe(a), describe(b)  # NOTE: the sizes, read again
    assert KVCacheDescriptor.from_json(agent_a.descriptor.to_json()) == agent_a.descriptor
    peer = agent_a.connect(agent_b.metadata())
    agent_b.connect(agent_a.metadata())
    gen = torch.Generator().manual_seed(5)
    for name in a.kv_caches:
        live = block_bytes(a, name, 12)
        live.copy_(torch.randint(-128, 128, live.shape, dtype=torch.int8, generator=gen))
    agent_a.write_blocks(peer, [12], [14]).wait(timeout=60)
    assert all(torch.equal(block_bytes(a, n, 12), block_bytes(b, n, 14)) for n in a.kv_caches)
    pool = HostKVPool(b, 2)
    pool.offload([14], [1])
    pool.restore([1], [15])
    assert all(torch.equal(block_bytes(b, n, 14), block_bytes(b, n, 15)) for n in b.kv_caches)
    agent_a.close()
    agent_b.close()


@pytest.mark.parametrize("kind, layout", CASES)
def test_coarse_granules_keep_every_live_block(kind, layout):
    """With granules larger than a block (16 KiB here, 2 MiB on a GPU) a granule shared by a live block stays."""
    from kvcore.memory.backing import reserve_backing
    from kvcore.memory.elastic import ElasticMemory
    from kvcore.memory.views import allocate_kv_cache

    plain = make_elastic(kind, layout, 12, None)
    config = plain.config
    backing = reserve_backing(config.kv_cache_tensors[0].size, "cpu", granularity=4 * mmap.PAGESIZE)
    views = allocate_kv_cache(config, "cpu", buffer=backing.tensor, kernel_block_sizes=plain.kernel_block_sizes
                              if kind == "split" else None)
    rows = {n: (v, v.shape[0] // 12) for n, v in views.items()}
    memory = ElasticMemory(backing)
    memory.track(rows)
    gen = torch.Generator().manual_seed(7)
    for n in (7, 3, 12, 2, 9):
        memory.resize(n)
        # NOTE: what is live now must survive the next resize
        for view, r in rows.values():
            view[: n * r].view(torch.int8).copy_(torch.randint(-128, 128, view[: n * r].view(torch.int8).shape,
                                                               dtype=torch.int8, generator=gen))
        kept = {name: view[: 2 * r].view(torch.int8).clone() for name, (view, r) in rows.items()}
        g = backing.granularity
        want = granules_touched(block_byte_ranges(rows, n), g)
        assert memory.committed_bytes == len(want) * g
        # NOTE: rounded out to whole granules, merged, and nothing else
        rounded = block_byte_ranges(rows, n, g)
        assert rounded == merge_ranges(rounded)
        assert {x for s, e in rounded for x in range(s // g, e // g)} == want
        assert all(s % g == 0 and e % g == 0 for s, e in rounded)
    memory.resize(2)
    assert all(torch.equal(view[: 2 * r].view(torch.int8), kept[name]) for name, (view, r) in rows.items())
