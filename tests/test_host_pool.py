"""HostKVPool: offload and restore move exactly the listed blocks' bytes, in every layout.

Round trip on random data: after offloading device blocks S to host slots H
and restoring H into device blocks D, every layer view's rows of D hold what
the rows of S held, and no other byte of the allocation changed.
"""

from __future__ import annotations

import pytest
import torch
from _transfer_caches import _SAME_SIZE_INT, KINDS, block_rows, brute_force_bytes, make_cache, raw_buffer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore import KVCacheLayout
from kvcore.transfer import HostKVPool, host_pool

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


def fill_random(kv, seed: int) -> None:
    raw = raw_buffer(kv)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int8).to(raw.device))


def bits(view: torch.Tensor) -> torch.Tensor:
    return view.view(_SAME_SIZE_INT[view.element_size()])


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CASES), st.data())
def test_offload_restore_round_trip_is_exact(case, data):
    kind, layout = case
    kv = make_cache(kind, layout)
    pool = HostKVPool(kv, num_host_blocks=5)
    fill_random(kv, seed=len(kind) * 7 + len(layout))
    n = data.draw(st.integers(1, 4))
    src = data.draw(st.lists(st.integers(1, kv.num_blocks - 1), min_size=n, max_size=n, unique=True))
    slots = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n, unique=True))
    dst = data.draw(st.lists(st.integers(1, kv.num_blocks - 1), min_size=n, max_size=n, unique=True))
    before = {name: bits(view).clone() for name, view in kv.kv_caches.items()}
    pool.offload(src, slots)
    untouched = [h for h in range(5) if h not in slots]
    assert all(pool.host_block(h).count_nonzero() == 0 for h in untouched)
    raw_before = raw_buffer(kv).clone()
    handle = pool.restore(slots, dst)
    handle.wait()
    layers = [n for n in kv.kv_caches if kv.config.group_of(n)[1].spec_of(n).has_layer_views]
    for name in layers:
        moved = bits(kv.kv_caches[name])[block_rows(kv, name, dst)]
        assert torch.equal(moved, before[name][block_rows(kv, name, src)]), name
    changed = brute_force_bytes(kv, dst, layers)
    raw = raw_buffer(kv)
    assert torch.equal(raw[~changed], raw_before[~changed]), "bytes outside the restored blocks changed"


def test_one_group_moves_only_that_groups_layers():
    """Groups overlay (a block id belongs to one group): only group 1's bytes of block 3 change."""
    kv = make_cache("state", "BLNHC")  # group 1: one Mamba layer, 140 of the block's 2048 bytes
    pool = HostKVPool(kv, num_host_blocks=2)
    fill_random(kv, seed=5)
    g1 = kv.config.kv_cache_groups[1].layer_names
    before = {name: bits(v).clone() for name, v in kv.kv_caches.items()}
    pool.offload([2], [1], group_id=1)
    raw_before = raw_buffer(kv).clone()
    pool.restore([1], [3], group_id=1)
    for name in g1:
        rows3 = bits(kv.kv_caches[name])[block_rows(kv, name, [3])]
        assert torch.equal(rows3, before[name][block_rows(kv, name, [2])]), name
    changed = brute_force_bytes(kv, [3], g1)
    assert int(changed.sum()) == 140 and pool.offload([2], [1], group_id=1).nbytes == 140
    assert torch.equal(raw_buffer(kv)[~changed], raw_before[~changed])


def test_consecutive_blocks_merge_into_one_copy_in_block_outermost_layouts():
    """Run by run (staging=False): adjacent on both sides merges; layer-compact: one per layer."""
    kv = make_cache("uniform", "BLNHC")
    pool, direct = HostKVPool(kv, num_host_blocks=4), HostKVPool(kv, 4, staging=False)
    assert direct.offload([2, 3, 4], [0, 1, 2]).num_runs == 1
    assert direct.offload([2, 4, 3], [0, 1, 2]).num_runs == 3
    compact = HostKVPool(make_cache("uniform", "LBNHC"), num_host_blocks=4, staging=False)
    assert compact.offload([2, 3], [0, 1]).num_runs == 2 * 3  # per layer, per block
    assert pool.block_bytes == compact.block_bytes == sum(
        v[0].numel() * v.element_size() for v in kv.kv_caches.values()
    )
    handle = pool.offload([2, 3, 4], [0, 1, 2], non_blocking=True)  # NOTE: on CPU: done on return
    assert handle.done() and handle.num_runs == 1


def test_bad_input_moves_nothing():
    kv = make_cache("uniform", "LBNHC")
    pool = HostKVPool(kv, num_host_blocks=3)
    fill_random(kv, seed=9)
    bad_calls = [
        (pool.offload, [1, 2], [0]),  # lengths differ
        (pool.offload, [0], [0]),  # null block
        (pool.offload, [1], [3]),  # host slot out of range
        (pool.offload, [1, 2], [0, 0]),  # one slot twice
        (pool.offload, [True], [0]),
        (pool.restore, [0, 1], [4, 4]),  # one device block twice
        (pool.restore, [0], [kv.num_blocks]),
        (pool.restore, [0.0], [1]),
    ]
    raw = raw_buffer(kv).clone()
    for call, a, b in bad_calls:
        with pytest.raises(ValueError):
            call(a, b)
    assert pool.host.count_nonzero() == 0 and torch.equal(raw_buffer(kv), raw)
    with pytest.raises(ValueError):
        HostKVPool(kv, 0)
    with pytest.raises(TypeError):
        HostKVPool(raw, 2)


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC", "LHBNC", "BHLNC"])
@pytest.mark.parametrize("chunk_blocks", [1, 64])
def test_cuda_round_trip_through_pinned_host_memory(layout, chunk_blocks, monkeypatch):
    """Gather and copy overlap on two streams (one block per chunk: three chunks in flight)."""
    kv = make_cache("uniform", layout, device="cuda")
    pool = HostKVPool(kv, num_host_blocks=4)
    monkeypatch.setattr(host_pool, "CHUNK_BYTES", chunk_blocks * pool.block_bytes)
    assert pool.host.is_pinned()
    fill_random(kv, seed=11)
    before = {name: bits(view).clone() for name, view in kv.kv_caches.items()}
    handle = pool.offload([1, 2, 5], [3, 0, 1], non_blocking=True)
    handle.wait()
    assert handle.done()
    kv_raw = raw_buffer(kv)
    kv_raw.zero_()
    torch.cuda.synchronize()
    pool.restore([3, 0, 1], [4, 6, 2]).wait()
    for name, view in kv.kv_caches.items():
        got = bits(view)[block_rows(kv, name, [4, 6, 2]).cuda()]
        assert torch.equal(got, before[name][block_rows(kv, name, [1, 2, 5]).cuda()]), name
    assert int(kv_raw.count_nonzero()) <= 3 * pool.block_bytes


@pytest.mark.parametrize("layout, copies", [("LBNHC", 2), ("LHBNC", 2), ("BLNHC", 2), ("BHLNC", 2)])
def test_staged_copies_store_the_same_slots_as_one_copy_per_run(layout, copies):
    """Blocks are gathered on the device in host-slot order first: same host bytes, one copy per streak of slots."""
    kv = make_cache("uniform", layout)
    fill_random(kv, seed=13)
    staged, direct = HostKVPool(kv, 4), HostKVPool(kv, 4, staging=False)
    handle = staged.offload([5, 1, 3], [2, 3, 0])
    direct.offload([5, 1, 3], [2, 3, 0])
    assert torch.equal(staged.host, direct.host) and staged.host.count_nonzero() > 0
    # staged: host slots 2, 3 are consecutive, one copy, slot 0 another
    assert handle.num_runs == copies
    before = raw_buffer(kv).clone()
    staged.restore([2, 3, 0], [2, 4, 6])
    after_staged = raw_buffer(kv).clone()
    raw_buffer(kv).copy_(before)
    direct.restore([2, 3, 0], [2, 4, 6])
    assert torch.equal(raw_buffer(kv), after_staged)


@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
@pytest.mark.parametrize("chunk_blocks", [1, 2, 64])
def test_staged_chunks_move_the_same_bytes_as_one_copy_per_run(layout, chunk_blocks, monkeypatch):
    """Any chunking (one block per chunk, a few, all): offload and restore bytes equal the direct path's."""
    kv = make_cache("uniform", layout, num_blocks=9)
    fill_random(kv, seed=17 + chunk_blocks)
    staged, direct = HostKVPool(kv, 6), HostKVPool(kv, 6, staging=False)
    monkeypatch.setattr(host_pool, "CHUNK_BYTES", chunk_blocks * staged.block_bytes)
    gen = torch.Generator().manual_seed(len(layout) + chunk_blocks)
    src = (torch.randperm(8, generator=gen)[:5] + 1).tolist()
    slots = torch.randperm(6, generator=gen)[:5].tolist()
    handle = staged.offload(src, slots)
    direct.offload(src, slots)
    assert torch.equal(staged.host, direct.host) and staged.host.count_nonzero() > 0
    assert handle.num_runs <= -(-5 // chunk_blocks) + 1  # merged: about one copy per chunk
    dst = (torch.randperm(8, generator=gen)[:5] + 1).tolist()
    before = raw_buffer(kv).clone()
    staged.restore(slots, dst)
    after_staged = raw_buffer(kv).clone()
    raw_buffer(kv).copy_(before)
    direct.restore(slots, dst)
    assert torch.equal(raw_buffer(kv), after_staged) and not torch.equal(after_staged, before)
