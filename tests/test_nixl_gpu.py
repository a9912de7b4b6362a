"""NixlAgent on CUDA memory (NIXL's UCX backend, VRAM): only the listed blocks' bytes move.

Two agents in one process on one GPU for every cache shape, host memory to
device memory and back, and two processes on the same GPU (metadata over a
Pipe). Skips without CUDA or without NIXL.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from _nixl_workers import fill, rows
from _transfer_caches import brute_force_bytes, make_cache, raw_buffer

transfer = pytest.importorskip("kvcore.transfer")
pytestmark = [
    pytest.mark.kvcore_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CASES = [("uniform", "LBNHC"), ("uniform", "BLNHC"), ("uniform", "LHBNC"), ("hybrid", "BHLNC"),
         ("state", "BLHNC"), ("split", "LBHNC")]


def agent_or_skip(name, kv):
    try:
        return transfer.NixlAgent(name, kv)
    except transfer.NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")


def cache(kind, layout, device, num_blocks, seed):
    kv = make_cache(kind, layout, num_blocks=num_blocks, device=device)
    fill(kv, seed)  # random bytes drawn on the host, then copied in
    return kv


def same(kv_a, ids_a, kv_b, ids_b) -> bool:
    got, sent = rows(kv_b, ids_b), rows(kv_a, ids_a)
    return all(torch.equal(got[n].cpu(), sent[n].cpu()) for n in sent)


def check_write_then_read(src, dst, agent_src):
    """src writes blocks 1, 2, 4 into dst's 5, 3, 8; nothing else of dst changes; then reads dst's 6."""
    before = raw_buffer(dst).clone()
    assert not same(src, [1, 2, 4], dst, [5, 3, 8])
    handle = agent_src.write_blocks(agent_src.peers[0], [1, 2, 4], [5, 3, 8])
    handle.wait(timeout=60)
    assert handle.nbytes > 0 and same(src, [1, 2, 4], dst, [5, 3, 8])
    outside = ~brute_force_bytes(dst, [5, 3, 8], list(dst.kv_caches))
    assert torch.equal(raw_buffer(dst)[outside], before[outside])
    agent_src.read_blocks(agent_src.peers[0], [6], [3]).wait(timeout=60)
    assert same(dst, [6], src, [3])


@pytest.mark.parametrize("kind, layout", CASES)
def test_vram_blocks_move_exactly_between_two_agents_on_one_gpu(kind, layout):
    a, b = cache(kind, layout, "cuda", 7, 1), cache(kind, layout, "cuda", 9, 2)
    agent_a, agent_b = agent_or_skip("gpu-a", a), agent_or_skip("gpu-b", b)
    try:
        assert agent_a.descriptor.allocations[0].device.startswith("cuda")
        agent_a.connect(agent_b.metadata())
        agent_b.connect(agent_a.metadata())
        check_write_then_read(a, b, agent_a)
    finally:
        agent_a.close()
        agent_b.close()


@pytest.mark.parametrize("src_device, dst_device", [("cpu", "cuda"), ("cuda", "cpu")])
def test_blocks_move_exactly_between_host_and_device_memory(src_device, dst_device):
    a, b = cache("uniform", "BLNHC", src_device, 7, 3), cache("uniform", "BLNHC", dst_device, 9, 4)
    agent_a, agent_b = agent_or_skip("mixed-a", a), agent_or_skip("mixed-b", b)
    try:
        agent_a.connect(agent_b.metadata())
        agent_b.connect(agent_a.metadata())
        check_write_then_read(a, b, agent_a)
    finally:
        agent_a.close()
        agent_b.close()


def test_two_processes_on_one_gpu_exchange_vram_blocks():
    kv = cache("uniform", "LBNHC", "cuda", 6, 5)
    agent = agent_or_skip("main", kv)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_peer, args=(there, "uniform", "LBNHC", 8, 6), daemon=True)
    proc.start()
    try:
        if not here.poll(180):
            pytest.fail("the peer process sent no metadata")
        name = agent.connect(here.recv())
        here.send(agent.metadata())
        transport = agent.transport(name)  # two processes on one GPU: CUDA IPC, not a host bounce
        assert transport.name == "cuda_ipc" and "two processes on one host" in transport.detail
        sent = rows(kv, [2, 5])
        agent.write_blocks(name, [2, 5], [7, 1]).wait(timeout=60)
        here.send(("rows", [7, 1]))
        got = here.recv()
        assert all(torch.equal(got[n], sent[n].cpu()) for n in sent)
        here.send(("rows", [3]))
        theirs = here.recv()
        before = raw_buffer(kv).clone()
        agent.read_blocks(name, [3], [4]).wait(timeout=60)
        mine = rows(kv, [4])
        assert all(torch.equal(mine[n].cpu(), theirs[n]) for n in theirs)
        outside = ~brute_force_bytes(kv, [4], list(kv.kv_caches))
        assert torch.equal(raw_buffer(kv)[outside], before[outside])
        here.send(("stop", None))
        assert here.recv() == "closed"
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        agent.close()
    assert proc.exitcode == 0


def _gpu_peer(conn, kind, layout, num_blocks, seed):
    """The other process: a CUDA cache served by its own agent; answers 'rows' until 'stop'."""
    kv = cache(kind, layout, "cuda", num_blocks, seed)
    agent = transfer.NixlAgent("peer", kv)
    conn.send(agent.metadata())
    agent.connect(conn.recv())
    while True:
        request, arg = conn.recv()
        if request != "rows":
            break
        conn.send({n: r.cpu() for n, r in rows(kv, arg).items()})
    agent.close()
    conn.send("closed")
