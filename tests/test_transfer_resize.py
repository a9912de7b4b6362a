"""Transfer objects across an elastic cache's resize: ids are checked against the cache's size
now on every path, an agent's prepared lists serve the blocks a grow adds, memory given back
takes no write from a peer that still holds the old size, and a peer's name is checked like
the rest of its metadata."""

from __future__ import annotations

import json

import pytest
import torch
from _elastic_caches import block_bytes, make_elastic

from kvcore.transfer import HostKVPool, NixlAgent, NixlUnavailableError, TransferError, describe


def fill(kv, block_id: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in kv.kv_caches:
        live = block_bytes(kv, name, block_id)
        live.copy_(torch.randint(-128, 128, live.shape, dtype=torch.int8, generator=gen))


def same(a, i: int, b, j: int) -> bool:
    return all(torch.equal(block_bytes(a, n, i), block_bytes(b, n, j)) for n in a.kv_caches)


def connected(a, b) -> tuple[NixlAgent, NixlAgent]:
    try:
        agent_a, agent_b = NixlAgent("a", a), NixlAgent("b", b)
    except NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    except Exception as exc:  # UCX cannot start in some sandboxes
        pytest.skip(f"NIXL/UCX could not start here: {exc!r}")
    agent_a.connect(agent_b.metadata())
    agent_b.connect(agent_a.metadata())
    return agent_a, agent_b


def test_a_host_pool_made_before_a_shrink_refuses_released_blocks_and_serves_the_rest():
    kv = make_elastic("hybrid", "LBNHC", 16, 16)
    pool = HostKVPool(kv, 4)
    kv.resize(4)
    committed = kv.committed_bytes
    for move in (lambda: pool.offload([10], [0]), lambda: pool.restore([0, 1, 2], [10, 11, 12]),
                 lambda: pool.restore([0, 1], [3, 12], group_id=0), lambda: pool.offload([2, 15], [0, 1])):
        with pytest.raises(ValueError, match=r"device block id 1[025] is not an integer in \[1, 4\)"):
            move()
    assert kv.committed_bytes == committed
    assert not any(block_bytes(kv, n, b).any() for n in kv.kv_caches for b in (10, 11, 12, 15))
    fill(kv, 3, seed=1)
    pool.offload([3], [2])
    pool.restore([2], [1])
    assert same(kv, 3, kv, 1)
    kv.resize(16)  # NOTE: and after a grow, the blocks it adds
    fill(kv, 15, seed=2)
    pool.offload([15], [0])
    pool.restore([0], [12])
    assert same(kv, 15, kv, 12)


def test_an_agent_made_before_a_shrink_refuses_released_local_blocks_on_every_path():
    a, b = make_elastic("uniform", "LBNHC", 16, 16), make_elastic("uniform", "LBNHC", 16, 16)
    agent_a, agent_b = connected(a, b)
    try:
        b.resize(4)
        for move in (lambda: agent_b.write_blocks("a", [10], [1]), lambda: agent_b.read_blocks("a", [1], [11]),
                     lambda: agent_b.read_head_slice("a", [1], [12], head_start=0)):
            with pytest.raises(ValueError, match=r"local block id 1[012] is not an integer in \[1, 4\)"):
                move()
        fill(a, 5, seed=3)
        agent_b.read_blocks("a", [5], [3]).wait(timeout=30)
        assert same(a, 5, b, 3)
    finally:
        agent_a.close()
        agent_b.close()


def test_a_peer_that_holds_the_old_size_cannot_write_into_memory_given_back():
    a, b = make_elastic("uniform", "LBNHC", 16, 16), make_elastic("uniform", "LBNHC", 16, 16)
    agent_a, agent_b = connected(a, b)
    try:
        b.resize(4)
        committed = b.committed_bytes
        fill(a, 1, seed=3)
        with pytest.raises(TransferError, match="resized its KV cache"):  # NOTE: refused by the memory itself
            agent_a.write_blocks("b", [1, 2, 3], [10, 11, 12]).wait(timeout=30)
        assert b.committed_bytes == committed
        assert not any(block_bytes(b, n, i).any() for n in b.kv_caches for i in (10, 11, 12))
        # NOTE: connected again (b's metadata states its size now), a refuses those ids itself
        assert agent_a.connect(agent_b.metadata()) == "b"
        with pytest.raises(ValueError, match=r"block id of peer 'b' 10 is not an integer in \[1, 4\)"):
            agent_a.write_blocks("b", [1], [10])
        agent_a.write_blocks("b", [1], [3]).wait(timeout=30)
        assert same(a, 1, b, 3)
    finally:
        agent_a.close()
        agent_b.close()


def test_an_agent_that_moved_blocks_before_a_grow_moves_the_new_ones_after_reconnecting():
    a, b = make_elastic("hybrid", "BLNHC", 4, 16), make_elastic("hybrid", "BLNHC", 4, 16)
    agent_a, agent_b = connected(a, b)
    try:
        fill(a, 1, seed=4)
        agent_a.write_blocks("b", [1], [2]).wait(timeout=30)  # NOTE: prepares the lists at 4 blocks
        agent_b.read_blocks("a", [1], [3]).wait(timeout=30)
        assert same(a, 1, b, 2) and same(a, 1, b, 3)
        a.resize(16)
        b.resize(16)
        agent_a.descriptor, agent_b.descriptor = describe(a), describe(b)
        agent_a.connect(agent_b.metadata())
        agent_b.connect(agent_a.metadata())
        fill(a, 12, seed=5)
        agent_a.write_blocks("b", [12, 1], [14, 15]).wait(timeout=30)
        agent_b.read_blocks("a", [12], [13]).wait(timeout=30)
        assert same(a, 12, b, 14) and same(a, 1, b, 15) and same(a, 12, b, 13)
    finally:
        agent_a.close()
        agent_b.close()


def test_peer_metadata_whose_name_is_no_string_is_refused():
    a, b = make_elastic("uniform", "BLNHC", 4, 8), make_elastic("uniform", "BLNHC", 4, 8)
    agent_a, agent_b = connected(a, b)
    try:
        magic, header, rest = agent_b.metadata().split(b"\n", 2)
        for name in (5, None, ["b"], {"name": "b"}, "", True):
            fields = {**json.loads(header), "name": name}
            tampered = b"\n".join([magic, json.dumps(fields).encode(), rest])
            with pytest.raises(ValueError, match=r"peer metadata names its agent .*not a non-empty str"):
                agent_a.connect(tampered)
        assert agent_a.peers == ["b"]
    finally:
        agent_a.close()
        agent_b.close()
