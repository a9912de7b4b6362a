"""AttentionGroup is a read-only view of its frozen negotiation record: nothing replaces it."""

from __future__ import annotations

import pytest
import torch
from _plugin_dists import clean_plugin_env, make_backend  # noqa: F401

import kvcore
from kvcore import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, compute_layout_strides

PLAIN = make_backend("plain")


def test_decisions_are_read_from_the_record_and_not_settable():
    spec = FullAttentionSpec(32, 2, 8, torch.float32)
    kv = kvcore.KVCache.create({"a": spec, "b": spec}, {"a": "torch", "b": "torch"}, device="cpu",
                               num_blocks=4, max_num_seqs=1, max_model_len=64)
    group = kv.group_of("a")
    record = kv.negotiation.groups[0].backends[0]
    assert group.record is record
    assert (group.backend, group.layer_names, group.kv_cache_spec) == (record.backend, ["a", "b"], record.kv_cache_spec)
    for name in ("backend", "layer_names", "kv_cache_spec", "kernel_block_size", "kernel_block_stride", "record",
                 "kv_cache_group_id"):
        with pytest.raises(AttributeError):
            setattr(group, name, None)
    # A negotiated group keeps its size: 32 (no split) cannot become 16 by hand.
    with pytest.raises(ValueError, match="negotiated with kernel block size 32, not 16"):
        group.create_metadata_builders("cpu", max_num_seqs=1, max_model_len=64, kernel_block_size=16)
    assert group.record is record and group.kernel_block_size is None


def test_a_hand_made_group_learns_a_packed_stride_once():
    spec = FullAttentionSpec(16, 1, 4, torch.float32, tokens_per_state=4)
    layers, num_blocks = ["a", "b"], 5
    strides = compute_layout_strides(spec, num_blocks, 2, "BLNHC")
    tensor = KVCacheTensor(num_blocks * strides[1], layers, strides[0], strides[1])
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(layers, spec)], "BLNHC")
    views = kvcore.allocate_kv_cache(config, "cpu")
    group = kvcore.AttentionGroup(PLAIN, layers, spec, 0, kernel_block_size=8)
    assert group.kernel_block_stride == 0
    kernel = group.map_kv_cache_to_kernel_blocks(views["a"])
    assert group.kernel_block_stride == 4 and kernel.shape == ((num_blocks - 1) * 4 + 2, 1, 2, 8)
    three = KVCacheTensor(num_blocks * strides[1] * 3 // 2, ["x", "y", "z"], strides[0], strides[1] * 3 // 2)
    other = kvcore.allocate_kv_cache(
        KVCacheConfig(num_blocks, [three], [KVCacheGroupSpec(["x", "y", "z"], spec)], "BLNHC"), "cpu")
    with pytest.raises(ValueError, match="not the view group 0 was negotiated for"):
        group.map_kv_cache_to_kernel_blocks(other["x"])
    assert group.kernel_block_stride == 4
