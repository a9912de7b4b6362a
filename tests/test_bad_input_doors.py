"""Smaller doors of issue #22: each bad value gets a TypeError/ValueError naming it and the remedy."""

from __future__ import annotations

import pytest
import torch

from kvcore import FullAttentionSpec, KVCache, MambaSpec, MLAAttentionSpec, block_hashes, get_plugin_manager
from kvcore.plugins.layouts import resolve_kv_cache_layout
from kvcore.runtime.block_pool import MAX_NUM_BLOCKS, BlockPool


@pytest.fixture(scope="module")
def kv():
    specs = {f"layers.{i}.attn": FullAttentionSpec(16, 2, 8, torch.float32) for i in range(2)}
    return KVCache.create(specs, dict.fromkeys(specs, "torch"), device="cpu", num_blocks=4, max_num_seqs=2,
                          max_model_len=64, plugin_manager=get_plugin_manager())


@pytest.mark.parametrize("common, match", [
    ([{"a": 1}], r"common\[0\] is a dict \(\{'a': 1\}\), not a CommonAttentionMetadata"),
    ([None], r"common\[0\] is a NoneType"),
    ({"a": 1}, "common must be a list of CommonAttentionMetadata, one per KV cache group, got dict"),
    ("abc", "got str"),
])  # fmt: skip
def test_build_metadata_takes_only_common_attention_metadata(kv, common, match):
    with pytest.raises(TypeError, match=match):
        kv.build_metadata(common)


@pytest.mark.parametrize("tokens, index, value", [
    ([True] * 8, 0, True), ([5, 6, 7, 8, 9, 10, 11, False], 7, False), ([256, 1, 0, 513, True, 2, 3, 4], 4, True),
])  # fmt: skip
def test_block_hashes_refuses_bools_as_the_pool_does(tokens, index, value):
    with pytest.raises(TypeError, match=rf"token_ids\[{index}\] is the bool {value}, not a token id; pass integer"):
        block_hashes(tokens, 4)
    with pytest.raises(TypeError, match="block id must be an integer, got the bool"):
        BlockPool(4).free(True)


def test_block_hashes_still_takes_zero_and_one_as_ids():
    ints = [1, 0, 1, 0, 256, 1, 0, 257]
    assert block_hashes(ints, 4) == block_hashes(torch.tensor(ints), 4)
    assert len(set(block_hashes(ints, 4))) == 2
    with pytest.raises(TypeError, match="bool"):
        block_hashes(torch.tensor(ints, dtype=torch.bool), 4)


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.complex128, torch.qint8])
def test_specs_refuse_dtypes_a_cache_cannot_store(dtype):
    with pytest.raises(ValueError, match=rf"FullAttentionSpec.dtype={dtype} is not a dtype a KV cache can store"):
        FullAttentionSpec(16, 2, 8, dtype)
    with pytest.raises(ValueError, match=r"MLAAttentionSpec.dtype=.*use a floating or integer dtype"):
        MLAAttentionSpec(16, 1, 8, dtype)
    with pytest.raises(ValueError, match=rf"MambaSpec.dtypes\[1\]={dtype} is not a dtype"):
        MambaSpec(16, [(4,), (4,)], [torch.float32, dtype])
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        FullAttentionSpec(16, 2, 8, "float32")
    assert FullAttentionSpec(16, 2, 8, torch.int8).page_size_bytes == 16 * 2 * 16


def test_a_bad_layout_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVCORE_KV_CACHE_LAYOUT", "bogus")
    with pytest.raises(ValueError, match=r"KVCORE_KV_CACHE_LAYOUT='bogus': unknown KV cache layout.*fix or unset"):
        resolve_kv_cache_layout([None])
    with pytest.raises(ValueError, match=r"^unknown KV cache layout 'zz'"):  # an argument is named as before
        resolve_kv_cache_layout([None], requested="zz")


def test_free_takes_a_zero_dim_tensor_as_one_id():
    pool = BlockPool(6)
    ids = pool.allocate(3)
    pool.free(torch.tensor(ids[0]))
    assert not pool.is_allocated(ids[0]) and pool.is_allocated(ids[1])
    pool.free(torch.tensor(ids[1:]))
    assert pool.num_free_blocks == 5
    with pytest.raises(TypeError, match=r"block id must be an integer, got tensor\(2.5"):
        pool.free(torch.tensor(2.5))


def test_a_pool_too_large_for_host_memory_is_refused_at_once():
    bound = f"num_blocks=1,099,511,627,776 is more than the {MAX_NUM_BLOCKS:,}"
    with pytest.raises(ValueError, match=rf"{bound}.*bigger block_size"):
        BlockPool(2**40)
    with pytest.raises(ValueError, match="more than"):
        BlockPool(MAX_NUM_BLOCKS + 1, enable_caching=True)
