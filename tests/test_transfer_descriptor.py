"""describe(): the descriptor states where every layer's K, V and states live, as plain JSON."""

from __future__ import annotations

import json

import pytest
import torch
from _transfer_caches import KINDS, cached_cache, raw_buffer

from kvcore import KVCache, MLAAttentionSpec, get_plugin_manager
from kvcore.transfer import KVCacheDescriptor, describe

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


@pytest.mark.parametrize("kind, layout", CASES)
def test_json_round_trip_and_plain_readability(kind, layout):
    kv = cached_cache(kind, layout)
    desc = describe(kv)
    assert KVCacheDescriptor.from_json(desc.to_json()) == desc
    data = json.loads(desc.to_json())  # readable without kvcore
    assert data["version"] == 1 and data["layout"] == layout and data["num_blocks"] == kv.num_blocks
    raw = raw_buffer(kv)
    assert data["allocations"] == [
        {"index": 0, "device": "cpu", "base_ptr": raw.data_ptr(), "size": raw.numel()}
    ]
    for g, group in zip(data["groups"], kv.config.kv_cache_groups):
        assert g["layer_names"] == group.layer_names
        assert g["block_size"] == group.kv_cache_spec.block_size
        for layer in g["layers"]:
            view = kv.kv_caches[layer["name"]]
            assert layer["offset"] == view.data_ptr() - raw.data_ptr()
            assert (layer["shape"], layer["strides"]) == (list(view.shape), list(view.stride()))
            assert layer["dtype"] == str(view.dtype).removeprefix("torch.")


def _row_bytes(raw: torch.Tensor, layer, block: int, head: int, state: int) -> torch.Tensor:
    """Bytes of (block, head, state) of a layer, found from the descriptor alone."""
    s = layer.byte_strides
    start = layer.offset + block * layer.manager_block_stride + head * s[1] + state * s[2]
    return raw[start : start + layer.content.content_bytes]


def test_content_map_locates_k_and_v_of_every_head():
    kv = cached_cache("uniform", "BHLNC")
    raw, desc = raw_buffer(kv), describe(kv)
    layer = desc.groups[0].layers[1]
    view = kv.kv_caches[layer.name]
    gen = torch.Generator().manual_seed(1)
    view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    k0, k1 = layer.content.k_bytes
    v0, v1 = layer.content.v_bytes
    assert (k1 - k0, v1 - v0) == (8 * 2, 8 * 2)
    for block, head, state in [(3, 0, 5), (6, 1, 15)]:
        row = _row_bytes(raw, layer, block, head, state)
        assert torch.equal(row[k0:k1].view(torch.float16), view[block, head, state, :8])
        assert torch.equal(row[v0:v1].view(torch.float16), view[block, head, state, 8:])


def test_content_map_locates_each_state_tensor():
    kv = cached_cache("state", "BLNHC")
    raw, desc = raw_buffer(kv), describe(kv)
    group = desc.groups[0]
    layer = group.layers[0]
    spec = kv.config.kv_cache_groups[0].kv_cache_spec
    states = spec.split_states(kv.kv_caches[layer.name])
    gen = torch.Generator().manual_seed(2)
    for tensor in states:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    assert layer.content.kind == "state" and len(layer.content.states) == 2
    for piece, tensor in zip(layer.content.states, states):
        assert piece.dtype == str(tensor.dtype).removeprefix("torch.") and piece.shape == tensor.shape[1:]
        row = _row_bytes(raw, layer, 4, 0, 0)[piece.start : piece.end]
        assert torch.equal(row.view(tensor.dtype).view(piece.shape), tensor[4])
    assert layer.block_bytes == sum(spec.state_bytes) < layer.manager_block_stride  # padding excluded


def test_mla_has_no_v_range_and_split_group_reports_the_ratio():
    spec = MLAAttentionSpec(16, 1, 64, torch.float16)
    kv = KVCache.create({"mla.0": spec}, {"mla.0": "torch"}, device="cpu", num_blocks=4, max_num_seqs=1,
                        max_model_len=32, plugin_manager=get_plugin_manager())
    content = describe(kv).groups[0].layers[0].content
    assert content.k_bytes == (0, 128) and content.v_bytes is None and content.head_size_v == 0
    group = describe(cached_cache("split", "LBHNC")).groups[0]
    assert (group.block_size, group.kernel_block_size, group.ratio, group.kernel_block_stride) == (32, 8, 4, 4)


def test_bad_descriptor_text_is_refused():
    desc = describe(cached_cache("uniform", "LBNHC"))
    data = json.loads(desc.to_json())
    data["version"] = 99
    for text in ["{", "[]", json.dumps(data), json.dumps({"version": 1})]:
        with pytest.raises(ValueError):
            KVCacheDescriptor.from_json(text)
    with pytest.raises(TypeError):
        describe({"layers.0": torch.zeros(4)})
