"""read_head_slice: a decode rank with fewer KV heads reads only its heads of a prefill rank's blocks.

Prefill holds 4 KV heads per layer, decode (tensor-parallel size 2) holds 2:
rank r reads heads 2r, 2r+1. After the read, the decode blocks hold exactly
those heads of the prefill blocks, in any pair of layouts, and no other
decode byte changed.
"""

from __future__ import annotations

import pytest
import torch
from _nixl_workers import fill
from _transfer_caches import block_rows, brute_force_bytes, make_cache, plugin_manager, raw_buffer

from kvcore import FullAttentionSpec, KVCache
from kvcore_torch.backend import TorchAttentionBackend

transfer = pytest.importorskip("kvcore.transfer")


def cache(layout: str, heads: int, num_blocks: int) -> KVCache:
    specs = {f"layers.{i}.attn": FullAttentionSpec(16, heads, 8, torch.float16) for i in range(3)}
    return KVCache.create(specs, dict.fromkeys(specs, TorchAttentionBackend), device="cpu", layout=layout,
                          num_blocks=num_blocks, max_num_seqs=2, max_model_len=64, plugin_manager=plugin_manager())


def agent(name, kv):
    try:
        return transfer.NixlAgent(name, kv)
    except transfer.NixlUnavailableError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    except Exception as exc:
        pytest.skip(f"NIXL/UCX could not start here: {exc!r}")


@pytest.mark.parametrize("prefill_layout, decode_layout", [("BLNHC", "LBHNC"), ("LHBNC", "BHLNC"), ("LBNHC", "LBNHC")])
def test_decode_rank_reads_only_its_heads(prefill_layout, decode_layout):
    prefill, decode = cache(prefill_layout, 4, 7), cache(decode_layout, 2, 9)
    fill(prefill, 1)
    fill(decode, 2)
    a, b = agent("prefill", prefill), agent("decode-rank1", decode)
    try:
        with pytest.raises(transfer.IncompatiblePeerError, match="heads|layout"):
            b.connect(a.metadata())  # whole-block compatibility fails: other head count
        peer = b.connect(a.metadata(), heads_may_differ=True)
        with pytest.raises(transfer.IncompatiblePeerError, match="head slices only"):
            b.read_blocks(peer, [1], [1])
        with pytest.raises(transfer.IncompatiblePeerError, match="do not exist"):
            b.read_head_slice(peer, [1], [1], head_start=3)
        before = raw_buffer(decode).clone()
        handle = b.read_head_slice(peer, [2, 5, 6], [8, 1, 3], head_start=2)
        handle.wait(timeout=30)
        for name in decode.kv_caches:
            got = decode.kv_caches[name].view(torch.int16)[block_rows(decode, name, [8, 1, 3])]
            want = prefill.kv_caches[name].view(torch.int16)[block_rows(prefill, name, [2, 5, 6])][:, 2:4]
            assert torch.equal(got, want), name
        moved = brute_force_bytes(decode, [8, 1, 3], list(decode.kv_caches))
        assert torch.equal(raw_buffer(decode)[~moved], before[~moved])
        assert handle.nbytes == int(moved.sum())
    finally:
        a.close()
        b.close()


def test_head_slice_runs_merge_where_a_heads_states_are_contiguous():
    prefill, decode = cache("LBHNC", 4, 7), cache("LBHNC", 2, 7)
    a, b = agent("p", prefill), agent("d", decode)
    try:
        peer = b.connect(a.metadata(), heads_may_differ=True)
        # LBHNC: heads 2..3 of one (layer, block) are one run on both sides -> 3 layers x 1 block
        assert b.read_head_slice(peer, [4], [2], head_start=2).num_runs == 3
    finally:
        a.close()
        b.close()


def test_a_kvcore_error_before_the_read_is_not_reported_as_a_nixl_failure(monkeypatch):
    prefill, decode = cache("LBHNC", 4, 7), cache("LBHNC", 2, 7)
    a, b = agent("p", prefill), agent("d", decode)
    try:
        peer = b.connect(a.metadata(), heads_may_differ=True)

        def refuse(device):
            raise ValueError(f"no memory kind for device {device!r}")

        monkeypatch.setattr("kvcore.transfer.nixl.mem_type", refuse)
        with pytest.raises(ValueError, match="no memory kind for device 'cpu'") as info:
            b.read_head_slice(peer, [4], [2], head_start=2)
        assert not isinstance(info.value, transfer.TransferError)
        assert "reconnect" not in str(info.value)
    finally:
        a.close()
        b.close()


def test_a_peer_with_other_kv_cache_groups_is_refused_for_head_slices_too():
    """heads_may_differ still needs the same KV cache groups: refused with why, not a bad group id."""
    a, b = agent("hybrid", make_cache("hybrid", "BLNHC")), agent("uniform", make_cache("uniform", "BLNHC"))
    try:
        with pytest.raises(transfer.IncompatiblePeerError, match="KV cache groups differ"):
            a.connect(b.metadata(), heads_may_differ=True)
        assert a.peers == []
    finally:
        a.close()
        b.close()
