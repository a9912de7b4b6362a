"""Shared input checks for paged-attention entry points."""

import pytest
import torch

from kvcore.plugins.paged_inputs import (
    check_batch,
    check_batch_shapes,
    check_block_ids,
    check_cache_view,
    check_index,
    check_tokens,
)

VIEW = torch.randn(4, 2, 16, 64)


def test_cache_view_splits_content_into_k_and_v():
    assert check_cache_view(VIEW, 32, None) == 32
    assert check_cache_view(VIEW, 48, 16) == 16
    with pytest.raises(ValueError, match="head_size=48 and head_size_v=32"):
        check_cache_view(VIEW, 48, 32)
    with pytest.raises(TypeError, match="4-D"):
        check_cache_view(VIEW[0], 32, None)
    with pytest.raises(TypeError, match="int8"):
        check_cache_view(VIEW.view(torch.int8), 32, None)
    with pytest.raises(TypeError, match="float16"):
        check_cache_view(VIEW, 32, None, dtypes=(torch.float16,))


def test_tokens_and_indices_must_match_the_cache():
    key = torch.randn(5, 2, 32)
    check_tokens("key", key, 5, 2, 32, VIEW)
    with pytest.raises(ValueError, match=r"key must have shape \(6, 2, 32\)"):
        check_tokens("key", key, 6, 2, 32, VIEW)
    with pytest.raises(TypeError, match="cast it first"):
        check_tokens("key", key.half(), 5, 2, 32, VIEW)
    with pytest.raises(TypeError, match="slot_mapping must be a 1-D int32 or int64"):
        check_index("slot_mapping", torch.ones(5), 1)


def test_batch_offsets_must_cover_the_tokens():
    starts, lens = check_batch(torch.tensor([0, 3, 4]), torch.tensor([7, 9]), torch.zeros(2, 3, dtype=torch.int32), 4)
    assert (starts, lens) == ([0, 3, 4], [7, 9])
    with pytest.raises(ValueError, match="run from 0 to the 5 query tokens"):
        check_batch(torch.tensor([0, 3, 4]), torch.tensor([7, 9]), torch.zeros(2, 3, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="request 0 has 3 new tokens but seq_len 2"):
        check_batch(torch.tensor([0, 3, 4]), torch.tensor([2, 9]), torch.zeros(2, 3, dtype=torch.int32), 4)


def test_batch_shapes_are_checked_without_reading_values():
    table = torch.zeros(2, 3, dtype=torch.int32)
    assert check_batch_shapes(torch.tensor([0, 3, 4]), torch.tensor([7, 9]), table) == 2
    with pytest.raises(ValueError, match="query_start_loc of length 3"):
        check_batch_shapes(torch.tensor([0, 3]), torch.tensor([7, 9]), table)
    with pytest.raises(ValueError, match="at least 2 rows"):
        check_batch_shapes(torch.tensor([0, 3, 4]), torch.tensor([7, 9]), table[:1])
    with pytest.raises(TypeError, match="block_table must be a 2-D"):
        check_batch_shapes(torch.tensor([0, 3, 4]), torch.tensor([7, 9]), table.float())


def test_block_ids_must_exist_and_cover_each_sequence():
    table = torch.tensor([[3, 1, 9], [2, 0, 0]])
    check_block_ids(table, [8, 4], block_size=4, num_blocks=4)  # only the blocks a request reads
    with pytest.raises(ValueError, match=r"request 0 reads block ids \[3, 1, 9\]"):
        check_block_ids(table, [9, 4], block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="needs 4 blocks of 4"):
        check_block_ids(table, [13, 4], block_size=4, num_blocks=10)
