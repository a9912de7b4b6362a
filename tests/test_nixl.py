"""NixlAgent over the real NIXL (UCX, host memory): only the listed blocks' bytes move.

Between two agents in one process for every layout and cache shape, and
between two processes (metadata over a Pipe) for a write and a read.
"""

from __future__ import annotations

import multiprocessing

import attrs
import pytest
import torch
from _nixl_workers import fill, rows
from _transfer_caches import brute_force_bytes, make_cache, raw_buffer

from kvcore.transfer.pairs import pair_runs
from kvcore.transfer.regions import group_selection, whole_block_patterns

transfer = pytest.importorskip("kvcore.transfer")
# Every cache shape and layout family (agents take ~1 s to start, so not every pair).
CASES = [("uniform", "LBNHC"), ("uniform", "LHBNC"), ("uniform", "BLNHC"), ("hybrid", "BHLNC"),
         ("state", "BLHNC"), ("split", "LBHNC")]


def agent_or_skip(name, kv):
    try:
        return transfer.NixlAgent(name, kv)
    except transfer.NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    except Exception as exc:  # UCX cannot start in some sandboxes
        pytest.skip(f"NIXL/UCX could not start here: {exc!r}")


def pair(kind, layout, blocks_a=7, blocks_b=9):
    a, b = make_cache(kind, layout, num_blocks=blocks_a), make_cache(kind, layout, num_blocks=blocks_b)
    fill(a, 1)
    fill(b, 2)
    agent_a, agent_b = agent_or_skip("a", a), agent_or_skip("b", b)
    assert agent_a.connect(agent_b.metadata()) == "b"
    assert agent_b.connect(agent_a.metadata()) == "a"
    return a, b, agent_a, agent_b


@pytest.mark.parametrize("kind, layout", CASES)
def test_write_and_read_move_exactly_the_listed_blocks(kind, layout):
    a, b, agent_a, agent_b = pair(kind, layout)
    try:
        sent = rows(a, [1, 2, 4])
        b_before = raw_buffer(b).clone()
        handle = agent_a.write_blocks("b", [1, 2, 4], [5, 3, 8])
        assert handle.backend == "UCX" and handle.transport == agent_a.transport("b")
        assert handle.transport.name == "cma" and "one process" in handle.transport.detail
        handle.wait(timeout=30)
        got = rows(b, [5, 3, 8])
        assert all(torch.equal(got[n], sent[n]) for n in sent)
        outside = ~brute_force_bytes(b, [5, 3, 8], list(b.kv_caches))
        assert torch.equal(raw_buffer(b)[outside], b_before[outside])
        expected = rows(b, [6])
        agent_a.read_blocks("b", [6], [3]).wait(timeout=30)
        assert all(torch.equal(rows(a, [3])[n], expected[n]) for n in expected)
    finally:
        agent_a.close()
        agent_b.close()


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
def test_prepared_lists_make_as_few_copies_as_the_plan(layout):
    """NIXL merges descriptors adjacent on both sides: the handle's copy count is the plan's."""
    a, b, agent_a, agent_b = pair("uniform", layout)
    try:
        for local, remote in (([4, 1, 2], [5, 3, 8]), ([1, 2, 3], [6, 7, 8]), ([3, 2], [7, 6])):
            groups = group_selection(agent_a.descriptor, None)
            planned = sum(p.num_runs for p in pair_runs(
                whole_block_patterns(agent_a.descriptor, groups), torch.tensor(local),
                whole_block_patterns(agent_b.descriptor, groups), torch.tensor(remote)))
            sent = rows(a, local)
            handle = agent_a.write_blocks("b", local, remote)
            handle.wait(timeout=30)
            assert handle.num_runs == planned
            assert all(torch.equal(rows(b, remote)[n], sent[n]) for n in sent)
    finally:
        agent_a.close()
        agent_b.close()


def test_incompatible_peers_are_refused_with_the_reason():
    a = make_cache("uniform", "BLNHC")
    agent = agent_or_skip("a", a)
    try:
        for other, reason in [
            (make_cache("uniform", "LBNHC"), "layout"),
            (make_cache("uniform", "BLNHC", dtype=torch.float32), "dtype"),
            (make_cache("hybrid", "BLNHC"), "groups|layers"),
        ]:
            peer = agent_or_skip("p", other)
            with pytest.raises(transfer.IncompatiblePeerError, match=reason):
                agent.connect(peer.metadata())
            peer.close()
        assert agent.peers == []
        with pytest.raises(ValueError, match="itself"):
            agent.connect(agent.metadata())
        with pytest.raises(ValueError, match="not from this kvcore"):
            agent.connect(b"garbage")
        with pytest.raises(ValueError, match="damaged"):
            agent.connect(agent.metadata()[:40])
    finally:
        agent.close()


def _tampered_metadata(peer, **changes):
    """The peer's real NIXL metadata with its kvcore descriptor altered (no check on the way)."""
    from kvcore.transfer import compat

    name, desc, _, agent_md = compat.unpack(peer.metadata())
    alloc = attrs.evolve(desc.allocations[0], **changes.pop("allocation", {}))
    layers = tuple(attrs.evolve(layer, **changes.pop("layer", {})) for layer in desc.groups[0].layers)
    groups = (attrs.evolve(desc.groups[0], layers=layers), *desc.groups[1:])
    return compat.pack(name, attrs.evolve(desc, allocations=(alloc,), groups=groups, **changes), agent_md)


def test_a_peer_whose_descriptor_is_tampered_is_refused_before_nixl_sees_it():
    a, b = make_cache("uniform", "LBNHC"), make_cache("uniform", "LBNHC")
    agent, peer = agent_or_skip("a", a), agent_or_skip("b", b)
    try:
        size = raw_buffer(b).numel()
        for changes, field in [
            ({"num_blocks": 10**6}, "shape\\[0\\]"),
            ({"layer": {"offset": size}}, "offset"),
            ({"allocation": {"base_ptr": -4096}}, "base_ptr"),
            ({"allocation": {"size": 100}}, "holds 100 bytes"),
        ]:
            with pytest.raises(transfer.IncompatiblePeerError, match=f"peer 'b' sent .*{field}"):
                agent.connect(_tampered_metadata(peer, **changes))
        assert agent.peers == []
        assert agent.connect(peer.metadata()) == "b"  # the untouched metadata is accepted
    finally:
        agent.close()
        peer.close()


def test_bad_transfer_input_moves_nothing():
    a, b, agent_a, agent_b = pair("uniform", "LBNHC")
    try:
        before_a, before_b = raw_buffer(a).clone(), raw_buffer(b).clone()
        bad = [
            lambda: agent_a.write_blocks("nobody", [1], [1]),
            lambda: agent_a.write_blocks("b", [1, 2], [1]),
            lambda: agent_a.write_blocks("b", [0], [1]),
            lambda: agent_a.write_blocks("b", [1], [9]),
            lambda: agent_a.write_blocks("b", [1, 2], [3, 3]),
            lambda: agent_a.read_blocks("b", [1], [7]),
            lambda: agent_a.read_blocks("b", [True], [1]),
            lambda: agent_a.read_blocks("b", [1], [2], group_id=3),
        ]
        for call in bad:
            with pytest.raises(ValueError):
                call()
        with pytest.raises(ValueError, match="got 2 block ids of peer 'b' and 1 local block id;"):
            agent_a.read_blocks("b", [1, 2], [3])
        assert torch.equal(raw_buffer(a), before_a) and torch.equal(raw_buffer(b), before_b)
        empty = agent_a.write_blocks("b", [], [])
        assert empty.nbytes == 0 and empty.num_runs == 0 and empty.done()
        assert not agent_a._prepared  # NOTE: nothing was prepared with NIXL for no blocks
    finally:
        agent_a.close()
        agent_b.close()


def test_two_processes_exchange_blocks_over_nixl():
    kv = make_cache("uniform", "BHLNC", num_blocks=6)
    fill(kv, 3)
    agent = agent_or_skip("main", kv)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer_entry, args=(there, "uniform", "BHLNC", 8, 4), daemon=True)
    proc.start()
    try:
        if not here.poll(120):
            pytest.fail("the peer process sent no metadata")
        peer_metadata = here.recv()
        name = agent.connect(peer_metadata)
        here.send(agent.metadata())
        sent = rows(kv, [2, 5])
        agent.write_blocks(name, [2, 5], [7, 1]).wait(timeout=30)
        here.send(("rows", [7, 1]))
        got = here.recv()
        assert all(torch.equal(got[n], sent[n]) for n in sent)
        here.send(("rows", [4]))
        theirs = here.recv()
        before = raw_buffer(kv).clone()
        here.send(("read", ([2], [4])))  # the peer pulls our block 2 into its block 4
        assert here.recv() == "done"
        here.send(("rows", [4]))
        pulled = here.recv()
        assert all(torch.equal(pulled[n], sent[n][: len(theirs[n])]) for n in sent)
        assert torch.equal(raw_buffer(kv), before)  # a read by the peer changes nothing here
        transport = agent.transport(name)
        assert (transport.name, transport.source) == ("cma", "inferred")
        assert "two processes on one host" in transport.detail
        here.send(("stop", None))
        assert here.recv() == "closed"
        proc.join(timeout=60)
        late = agent_or_skip("late", make_cache("uniform", "BHLNC", num_blocks=5))
        try:  # the peer has exited: NIXL's raw error becomes kvcore's, naming the peer and the remedy
            with pytest.raises(transfer.TransferError, match="peer 'peer'.*restart the peer"):
                late.connect(peer_metadata)
        finally:
            late.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        agent.close()
    assert proc.exitcode == 0


def _peer_entry(conn, *args):
    from _nixl_workers import peer

    peer(conn, *args)
