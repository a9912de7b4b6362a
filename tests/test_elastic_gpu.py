"""Elastic KV caches on a GPU (CUDA virtual memory): skipped without CUDA.

- grow and shrink keep every live byte and every view's address, new blocks
  are zeroed when handed out, and a shrink gives the memory back to the
  device (``torch.cuda.mem_get_info``);
- a CUDA graph captured before a grow replays over blocks that only the grow
  created;
- a NIXL registration made before a grow moves blocks the grow created;
- ``kvcore.hf.Engine`` with the Triton backend (decode CUDA graphs) gives the
  same tokens on an elastic cache as on a plain one;
- a resize that raises at any step (a mapping, a release, the pool; Ctrl-C too) leaves
  memory, pool and zeroer at the old size, and live bytes unchanged.
"""

from __future__ import annotations

import pytest
import torch
from _elastic_caches import Faults, block_bytes

from kvcore import FullAttentionSpec, KVCache
from kvcore_torch.backend import TorchAttentionBackend

pytestmark = [
    pytest.mark.kvcore_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LAYOUTS = ["LBNHC", "LHBNC", "BLNHC", "BHLNC"]


def elastic(layout: str, num_blocks: int, max_num_blocks: int) -> KVCache:
    """4 layers of 8 KV heads of 128 in bf16: 256 KiB per block."""
    pytest.importorskip("cuda.bindings", reason="cuda-bindings (pip install 'kvcore[elastic]') is not installed")
    specs = {f"layers.{i}.attn": FullAttentionSpec(16, 8, 128, torch.bfloat16) for i in range(4)}
    return KVCache.create(specs, dict.fromkeys(specs, TorchAttentionBackend), device="cuda", layout=layout,
                          num_blocks=num_blocks, max_num_blocks=max_num_blocks, max_num_seqs=4, max_model_len=256)


def fill(kv: KVCache, ids: list[int], seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for b in ids:
        for name in kv.kv_caches:
            live = block_bytes(kv, name, b)
            live.copy_(torch.randint(-128, 128, live.shape, dtype=torch.int8, device="cuda", generator=gen))
            out[(b, name)] = live.clone()
    return out


def device_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grow_and_shrink_in_place_and_give_memory_back(layout):
    kv = elastic(layout, 64, 4096)  # 1 GiB reserved, 16 MiB committed
    assert kv.committed_bytes % (2 * 2**20) == 0 and kv.committed_bytes <= 64 * 2**20  # LHBNC: 32 runs
    ptrs = {n: v.data_ptr() for n, v in kv.kv_caches.items()}
    low = kv.block_pool.allocate(63)
    kv.begin_step()
    kept = fill(kv, low, 1)
    kv.resize(4096)
    assert kv.committed_bytes >= 4096 * 256 * 2**10
    high = kv.block_pool.allocate(4096 - 64)
    assert kv.begin_step() == high
    for name in kv.kv_caches:
        assert not block_bytes(kv, name, 4095).any() and not block_bytes(kv, name, 64).any()
    fill(kv, [4095, 2000], 2)
    assert all(torch.equal(block_bytes(kv, n, b), v) for (b, n), v in kept.items())
    with pytest.raises(ValueError, match="held"):
        kv.resize(64)
    kv.block_pool.free(high)
    grown, before = kv.committed_bytes, device_used()
    kv.resize(64)
    assert before - device_used() >= 0.9 * (grown - kv.committed_bytes)
    assert {n: v.data_ptr() for n, v in kv.kv_caches.items()} == ptrs
    assert all(torch.equal(block_bytes(kv, n, b), v) for (b, n), v in kept.items())


def test_a_cuda_graph_replays_across_a_grow():
    kv = elastic("LBNHC", 16, 2048)
    view = next(iter(kv.kv_caches.values()))
    src = torch.tensor([1], device="cuda")
    dst = torch.tensor([2], device="cuda")
    kv.block_pool.allocate(3)
    kv.begin_step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        view.index_copy_(0, dst, view.index_select(0, src) * 2)  # NOTE: warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        view.index_copy_(0, dst, view.index_select(0, src) * 2)
    kv.resize(2048)
    view[2000].copy_(torch.randn(view[2000].shape, device="cuda"))  # NOTE: numbers, not random bit patterns
    src.fill_(2000)
    dst.fill_(2047)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(view[2047], view[2000] * 2) and view[2000].abs().sum() > 0


def test_a_nixl_registration_made_before_a_grow_moves_new_blocks():
    transfer = pytest.importorskip("kvcore.transfer")
    a, b = elastic("BLNHC", 4, 64), elastic("BLNHC", 4, 64)
    try:
        agent_a, agent_b = transfer.NixlAgent("elastic-a", a), transfer.NixlAgent("elastic-b", b)
    except transfer.NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    a.resize(64)
    b.resize(64)
    # NOTE: the registrations stay; only the descriptors (block counts) are read again.
    agent_a.descriptor, agent_b.descriptor = transfer.describe(a), transfer.describe(b)
    peer = agent_a.connect(agent_b.metadata())
    agent_b.connect(agent_a.metadata())
    sent = fill(a, [60], 4)
    agent_a.write_blocks(peer, [60], [61]).wait(timeout=60)
    assert all(torch.equal(block_bytes(b, n, 61), sent[(60, n)]) for n in a.kv_caches)
    agent_a.close()
    agent_b.close()


def test_engine_tokens_on_an_elastic_cache_with_decode_graphs():
    pytest.importorskip("transformers")
    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    pytest.importorskip("cuda.bindings")
    model = random_model(model_config("llama"), dtype=torch.bfloat16, device="cuda", seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 17, 33, 9, 26)]
    from kvcore_triton.backend import TritonAttentionBackend as triton

    plain = Engine(model, backend=triton, num_blocks=256, max_num_seqs=4)
    grown = Engine(model, backend=triton, num_blocks=4, max_num_blocks=256, max_num_seqs=4)
    assert grown.generate(prompts, 12) == plain.generate(prompts, 12)
    assert grown.stats().graph_steps > 0 and grown.stats().preemptions == 0 and grown.kv.num_blocks == 4


@pytest.mark.parametrize("seam, fail_at, grow", [("commit", 0, True), ("commit", 2, True), ("pool", 0, True),
                                                 ("decommit", 0, False), ("decommit", 2, False), ("pool", 0, False)])
def test_a_resize_that_raises_anywhere_changes_nothing(seam, fail_at, grow):
    kv = elastic("LBNHC", 4, 256)  # NOTE: 64 KiB a block per layer: 4 -> 200 maps granules in every layer
    sent = fill(kv, [1, 3], 5)
    if not grow:
        kv.resize(200)
    faults = Faults(kv, seam, fail_at)
    before = faults.state()
    with pytest.raises(KeyboardInterrupt):
        kv.resize(200 if grow else 8)
    assert faults.state() == before
    faults.check()
    faults.seam = None
    kv.resize(200 if grow else 8)  # NOTE: the retry works
    faults.check()
    assert all(torch.equal(block_bytes(kv, n, b), sent[(b, n)]) for b in (1, 3) for n in kv.kv_caches)
