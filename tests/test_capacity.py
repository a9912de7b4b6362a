"""KVCacheConfig.token_capacity and friends: what one sequence (or many) can really hold."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.memory.planner import plan_kv_cache
from kvcore.model_files import load_model_file
from kvcore.specs import (
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

F16 = torch.float16


def full(bs=16, heads=1, hs=8):
    return FullAttentionSpec(bs, heads, hs, F16)


def test_one_full_layer_two_blocks_holds_one_block_of_tokens():
    config = plan_kv_cache({"a": full()}, "LBNHC", num_blocks=2)
    # Block 0 is the null block: one usable 16-token block.
    assert config.token_capacity == 16
    assert config.group_token_capacity(0) == 16
    assert config.blocks_per_sequence(16) == 1 and config.blocks_per_sequence(17) == 2


def test_groups_round_up_to_whole_blocks_each():
    # Two groups of 16-token blocks share 9 usable blocks: 4 + 4 blocks hold 64 tokens;
    # a 65th token needs a fifth block in both groups (10 > 9).
    specs = {"f": full(), "s": SlidingWindowSpec(16, 1, 8, F16, sliding_window=32)}
    config = plan_kv_cache(specs, "LBNHC", num_blocks=10)
    assert len(config.kv_cache_groups) == 2
    assert config.token_capacity == 64
    assert [config.group_token_capacity(g) for g in (0, 1)] == [144, 144]


def test_state_group_takes_one_block_per_sequence():
    mamba = MambaSpec(16, [(4, 16)], [F16])  # 128-byte state, padded to the 256-byte page
    specs = {"m": mamba, "a": full()}
    config = plan_kv_cache(specs, "LBNHC", num_blocks=6)
    state = [g for g in range(2) if config.is_state_group(g)]
    attn = [g for g in range(2) if not config.is_state_group(g)]
    assert len(state) == 1 and len(attn) == 1
    bs = config.kv_cache_groups[attn[0]].kv_cache_spec.block_size
    # 5 usable blocks: one for the state, four for attention.
    assert config.token_capacity == 4 * bs
    with pytest.raises(ValueError, match="state cache.*sequence_capacity"):
        config.group_token_capacity(state[0])
    assert config.sequence_capacity(bs) == 2  # 2 blocks per sequence, 5 usable


def test_all_state_model_counts_sequences_not_tokens():
    mamba = MambaSpec(16, [(4, 16)], [F16])
    config = plan_kv_cache({"m0": mamba, "m1": mamba}, "LBNHC", num_blocks=9)
    assert config.is_state_group(0)
    assert config.token_capacity == 0
    assert config.sequence_capacity(1) == config.sequence_capacity(10**6) == 8


def test_encoder_only_group_holds_no_tokens():
    enc = EncoderOnlyAttentionSpec(16, 1, 8, F16)
    config = plan_kv_cache({"e": enc, "a": full()}, "LBNHC", num_blocks=4)
    enc_id = next(g for g, grp in enumerate(config.kv_cache_groups) if grp.layer_names == ["e"])
    assert not config.is_state_group(enc_id)
    with pytest.raises(ValueError, match="keeps no KV cache"):
        config.group_token_capacity(enc_id)
    assert config.token_capacity == 3 * 16


def test_group_id_is_checked():
    config = plan_kv_cache({"a": full()}, "LBNHC", num_blocks=4)
    with pytest.raises(ValueError, match="group_id=1 is out of range.*1 KV cache groups"):
        config.group_token_capacity(1)
    with pytest.raises(TypeError, match="group_id"):
        config.is_state_group("0")
    with pytest.raises(ValueError, match="num_tokens"):
        config.blocks_per_sequence(0)


def test_gemma_3_27b_readme_figure_is_exact():
    model = load_model_file("gemma-3-27b")
    config = plan_kv_cache(model.kv_cache_specs, "BLNHC", available_memory=40 << 30)
    capacity = config.token_capacity
    assert capacity == 74_896
    assert config.blocks_per_sequence(capacity) <= config.num_blocks - 1
    assert config.blocks_per_sequence(capacity + 1) > config.num_blocks - 1


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    block_sizes=st.lists(st.sampled_from([1, 2, 3, 16, 32, 48]), min_size=1, max_size=4),
    num_states=st.integers(0, 2),
    num_blocks=st.integers(2, 300),
)
def test_capacity_is_the_largest_length_that_fits(block_sizes, num_states, num_blocks):
    specs = {f"a{i}": full(bs=bs, heads=1 + i) for i, bs in enumerate(block_sizes)}
    specs.update({f"m{i}": MambaSpec(16, [(2 + i,)], [F16]) for i in range(num_states)})
    try:
        config = plan_kv_cache(specs, "BLNHC", num_blocks=num_blocks)
    except ValueError:
        return  # pages that cannot be unified (checked by the planner tests)
    groups = [g.kv_cache_spec for g in config.kv_cache_groups]
    attn = [s.block_size for s in groups if not isinstance(s, MambaSpec)]
    state = sum(isinstance(s, MambaSpec) for s in groups)

    def need(tokens):  # blocks one sequence of ``tokens`` takes, counted independently
        return state + sum(math.ceil(tokens / bs) for bs in attn)

    capacity = config.token_capacity
    usable = num_blocks - 1
    if need(1) > usable:
        assert capacity == 0
    else:
        assert need(capacity) <= usable < need(capacity + 1)
    for g in range(len(groups)):
        if not config.is_state_group(g):
            assert config.group_token_capacity(g) >= capacity
