"""Bad input found in review: each raises ValueError/TypeError naming the value."""

import pytest
import torch

from kvcore import (
    AttentionGroup,
    FullAttentionSpec,
    KVCacheGroupSpec,
    gather_mm_placeholders,
    get_plugin_manager,
    plan_kv_cache,
    select_common_block_size,
)
from kvcore.plugins.backend import AttentionBackend

SPEC = FullAttentionSpec(16, 2, 8, torch.float32)


def test_plan_needs_at_least_two_blocks():
    with pytest.raises(ValueError, match="num_blocks=1 .*null block"):
        plan_kv_cache({"a": SPEC}, "LBNHC", num_blocks=1)
    assert plan_kv_cache({"a": SPEC}, "LBNHC", num_blocks=2).num_blocks == 2


def test_group_spec_needs_layers():
    with pytest.raises(ValueError, match="at least one layer"):
        KVCacheGroupSpec([], SPEC)


def test_gather_mask_must_match_the_placeholders():
    rows = torch.randn(4, 3)
    with pytest.raises(ValueError, match="is_embed has 3 entries for 4"):
        gather_mm_placeholders(rows, torch.tensor([True, False, True]))
    assert torch.equal(gather_mm_placeholders(rows, torch.tensor([True, False, True, False])), rows[[0, 2]])


def test_backends_must_be_a_list():
    with pytest.raises(TypeError, match=r"wrap it: \['torch'\]"):
        select_common_block_size(16, "torch", plugin_manager=get_plugin_manager(autoload=False))


def test_kernel_block_table_checks_shape_and_micro_batch():
    class Any16(AttentionBackend):
        name = "any16"

    group = AttentionGroup(Any16, ["a"], FullAttentionSpec(64, 2, 8, torch.float32), 0, kernel_block_size=16)
    group.kernel_block_table = torch.zeros(1, 2, 8, dtype=torch.int32)
    group.kernel_block_offsets = torch.arange(4, dtype=torch.int32)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    assert group.map_to_kernel_block_table(table).tolist() == [[12, 13, 14, 15, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="2-D"):
        group.map_to_kernel_block_table(table[0])
    with pytest.raises(ValueError, match="micro-batch 1"):
        group.map_to_kernel_block_table(table, ubatch_idx=1)
