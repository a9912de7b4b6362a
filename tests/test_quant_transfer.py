"""Quantized caches in the transfer layer: the descriptor records the mode and where the scales
are, transfer plans and the host tier move data with its scales, and a peer of another mode
is refused (it would misread the bytes)."""

from __future__ import annotations

import json

import pytest
import torch
from _quant_caches import MODES, PER_TOKEN_HEAD, block_byte_mask, byte_offsets, layer_specs, make_quant_cache, raw

from kvcore import KVCacheLayout
from kvcore.transfer import HostKVPool, KVCacheDescriptor, describe, plan_transfer
from kvcore.transfer.compat import IncompatiblePeerError, check_peer, incompatibility

LAYOUTS = [layout.name for layout in KVCacheLayout]


def _fill(kv, seed):
    gen = torch.Generator().manual_seed(seed)
    memory = raw(kv)
    memory.copy_(torch.randint(-128, 128, memory.shape, generator=gen, dtype=torch.int8))


@pytest.mark.parametrize("mode", MODES)
def test_descriptor_records_the_mode_and_the_scales_and_round_trips(mode):
    kv = make_quant_cache(mode, "BLNHC")
    descriptor = describe(kv)
    data = json.loads(descriptor.to_json())
    assert data["kv_cache_dtype"] == mode
    assert KVCacheDescriptor.from_json(descriptor.to_json()) == descriptor
    for layer in descriptor.groups[0].layers:
        view = kv.kv_caches[layer.name]
        assert layer.dtype == str(view.dtype).removeprefix("torch.") and layer.itemsize == 1
        if mode in PER_TOKEN_HEAD:
            scales = kv.scale_caches[layer.name]
            assert layer.scales.shape == tuple(scales.shape) and layer.scales.strides == scales.stride()
            assert layer.scales.offset == scales.data_ptr() - raw(kv).data_ptr()
        else:
            assert layer.scales is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_transfer_plans_cover_exactly_the_blocks_data_and_scales(mode, layout):
    kv = make_quant_cache(mode, layout)
    descriptor = describe(kv)
    for ids in ([1], [2, 3], [6, 1, 4]):
        planned = torch.zeros(raw(kv).numel(), dtype=torch.bool)
        for region in plan_transfer(descriptor, ids):
            assert not planned[region.offset : region.end].any()
            planned[region.offset : region.end] = True
        assert torch.equal(planned, block_byte_mask(kv, ids))
    if layout.startswith("B"):  # block-outermost: one run per block, scales included
        assert len(plan_transfer(descriptor, [1, 4])) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", PER_TOKEN_HEAD)
def test_host_tier_round_trip_carries_the_scales(mode, layout):
    kv = make_quant_cache(mode, layout)
    _fill(kv, seed=3)
    before = raw(kv).clone()
    pool = HostKVPool(kv, num_host_blocks=3)
    pool.offload([1, 5], [0, 2]).wait()
    raw(kv).zero_()
    pool.restore([0, 2], [4, 5]).wait()
    for views in (kv.kv_caches, kv.scale_caches):
        for view in views.values():
            for src, dst in ((1, 4), (5, 5)):
                got, want = byte_offsets(view[dst]).flatten(), byte_offsets(view[src]).flatten()
                assert torch.equal(raw(kv)[got], before[want])
    assert (raw(kv)[~block_byte_mask(kv, [4, 5])] == 0).all()


def test_peers_of_another_mode_are_refused_even_for_head_slices():
    fp8, int8, plain = (describe(make_quant_cache(m, "LBNHC")) for m in ("fp8", "int8_per_token_head", "auto"))
    e5m2 = describe(make_quant_cache("fp8_e5m2", "LBNHC"))
    for a, b in ((fp8, plain), (fp8, int8), (fp8, e5m2)):
        assert "KV cache dtype" in incompatibility(a, b)
        for heads_may_differ in (False, True):
            with pytest.raises(IncompatiblePeerError, match="KV cache dtype"):
                check_peer("peer", a, b, heads_may_differ)
    assert incompatibility(fp8, describe(make_quant_cache("fp8", "LBNHC", num_blocks=11))) is None
    with pytest.raises(IncompatiblePeerError, match="per-token-head scales"):  # same mode, other heads
        check_peer("peer", int8, describe(make_quant_cache("int8_per_token_head", "LBNHC",
                                                           specs=layer_specs(heads=4))), True)


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(kv_cache_dtype="fp4"), "kv_cache_dtype"),
    (lambda d: d.update(kv_cache_dtype=8), "kv_cache_dtype"),
    (lambda d: d["groups"][0]["layers"][0]["scales"].update(shape=[8, 2, 16, 3]), "scales"),
    (lambda d: d["groups"][0]["layers"][0]["scales"].update(offset=10**9), "scales.offset"),
    (lambda d: d["groups"][0]["layers"][0]["scales"].update(strides=[1, 1, 1, 1]), "scales"),
])
def test_a_descriptor_with_bad_quantization_fields_is_refused(change, match):
    data = json.loads(describe(make_quant_cache("fp8_per_token_head", "LBNHC")).to_json())
    change(data)
    with pytest.raises((ValueError, TypeError), match=match):
        KVCacheDescriptor.from_json(json.dumps(data))


def test_nixl_agents_refuse_a_peer_of_another_mode_and_move_scales():
    transfer = pytest.importorskip("kvcore.transfer")
    a, b = make_quant_cache("int8_per_token_head", "LBNHC"), make_quant_cache("int8_per_token_head", "LBNHC")
    other = make_quant_cache("fp8_per_token_head", "LBNHC")
    agents = []
    try:
        for name, kv in (("a", a), ("b", b), ("o", other)):
            try:
                agents.append(transfer.NixlAgent(name, kv))
            except Exception as exc:  # NOTE: NIXL missing, or UCX cannot start in this sandbox
                pytest.skip(f"NIXL is not usable here: {exc!r}")
        agent_a, agent_b, agent_o = agents
        with pytest.raises(transfer.IncompatiblePeerError, match="KV cache dtype"):
            agent_a.connect(agent_o.metadata())
        assert agent_a.connect(agent_b.metadata()) == "b"
        _fill(a, seed=4)
        raw(b).zero_()
        agent_a.write_blocks("b", [2, 3], [2, 3]).wait(timeout=30)
        moved = block_byte_mask(b, [2, 3])
        assert torch.equal(raw(b)[moved], raw(a)[moved]) and (raw(b)[~moved] == 0).all()
    finally:
        for agent in agents:
            agent.close()
