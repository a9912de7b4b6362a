"""plan_transfer: the fewest exact byte runs of a set of manager blocks.

Invariant, checked against a brute-force byte set (every byte the views of
the selected layers address for the listed blocks): the plan's runs cover
exactly those bytes, are sorted and disjoint, and never touch (so no fewer
runs could cover them).
"""

from __future__ import annotations

import pytest
import torch
from _transfer_caches import KINDS, brute_force_bytes, cached_cache, raw_buffer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.transfer import describe, plan_transfer

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


def region_mask(regions, nbytes: int) -> torch.Tensor:
    mask = torch.zeros(nbytes, dtype=torch.bool)
    for r in regions:
        mask[r.offset : r.end] = True
    return mask


@st.composite
def plan_inputs(draw):
    kind, layout = draw(st.sampled_from(CASES))
    kv = cached_cache(kind, layout)
    group_id = draw(st.integers(0, kv.num_groups - 1))
    names = [n for n in kv.config.kv_cache_groups[group_id].layer_names if n in kv.kv_caches]
    layers = draw(st.none() | st.lists(st.sampled_from(names), min_size=1, unique=True))
    ids = draw(st.lists(st.integers(1, kv.num_blocks - 1), max_size=kv.num_blocks + 2))
    return kv, group_id, layers, ids


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan_inputs())
def test_plan_covers_exactly_the_blocks_bytes_in_fewest_runs(inputs):
    kv, group_id, layers, ids = inputs
    desc = describe(kv)
    regions = plan_transfer(desc, ids, group_id=group_id, layers=layers)
    names = layers or [l.name for l in desc.groups[group_id].layers]
    nbytes = raw_buffer(kv).numel()
    assert torch.equal(region_mask(regions, nbytes), brute_force_bytes(kv, ids, names))
    assert all(r.length > 0 and r.allocation == 0 for r in regions)
    assert all(a.end < b.offset for a, b in zip(regions, regions[1:])), "runs must be sorted, apart"


def streaks(ids):
    ids = sorted(set(ids))
    return sum(1 for i, b in enumerate(ids) if i == 0 or ids[i - 1] != b - 1)


@pytest.mark.parametrize("layout", ["BLNHC", "BLHNC", "BHLNC"])
def test_block_outermost_gives_one_run_per_block_for_all_layers(layout):
    desc = describe(cached_cache("uniform", layout))
    assert len(plan_transfer(desc, [1, 3, 5])) == 3
    assert len(plan_transfer(desc, [2, 3, 4, 6])) == 2
    assert plan_transfer(desc, [1])[0].length == 3 * desc.groups[0].layers[0].block_bytes


@pytest.mark.parametrize("layout, per_block", [("LBNHC", 3), ("LBHNC", 3), ("LHBNC", 6)])
def test_layer_compact_gives_one_run_per_layer_and_block(layout, per_block):
    """Three layers; LHBNC stores each of the two heads of a block apart."""
    desc = describe(cached_cache("uniform", layout))
    for ids in ([1, 3, 5], [2, 3, 4, 6], [4]):
        assert len(plan_transfer(desc, ids)) == per_block * streaks(ids)


def test_split_group_states_the_manager_stride_not_the_kernel_stride():
    kv = cached_cache("split", "LBNHC")
    layer = describe(kv).groups[0].layers[0]
    view = kv.kv_caches[layer.name]
    assert layer.rows_per_block == 4 and view.shape[0] == 4 * kv.num_blocks
    assert layer.manager_block_stride == kv.config.kv_cache_tensors[0].block_stride
    assert layer.manager_block_stride == 4 * view.stride(0) * view.element_size()
    assert len(plan_transfer(describe(kv), [2])) == 2  # one run per layer: the 4 kernel blocks merge


def test_bad_ids_and_arguments_are_refused():
    desc = describe(cached_cache("hybrid", "LBNHC"))
    n = desc.num_blocks
    for bad in ([n], [-1], [True], [1.0], ["1"], "12", None, torch.tensor([0.5]), torch.tensor([n]),
                [0], [2, 0], torch.tensor([3, 0]), {1: "a", 2: "b"}, {1, 2}):
        with pytest.raises(ValueError, match="block ids|block id"):
            plan_transfer(desc, bad)
    with pytest.raises(ValueError, match="null block"):
        plan_transfer(desc, [1, 0])
    with pytest.raises(ValueError, match="group_id"):
        plan_transfer(desc, [1], group_id=2)
    with pytest.raises(ValueError, match="no cache view"):
        plan_transfer(desc, [1], layers=["layers.1.attn"])  # layer of group 1
    with pytest.raises(TypeError):
        plan_transfer(desc.to_json(), [1])
    assert plan_transfer(desc, []) == []
    assert plan_transfer(desc, torch.tensor([1, 1], dtype=torch.int32)) == plan_transfer(desc, [1])


def test_one_layer_name_as_a_string_is_a_type_error_that_says_to_pass_a_list():
    desc = describe(cached_cache("hybrid", "LBNHC"))
    name = desc.group(0).layers[0].name
    with pytest.raises(TypeError, match=rf"got the string '{name}'; pass \['{name}'\]"):
        plan_transfer(desc, [1], layers=name)
    assert plan_transfer(desc, [1], layers=[name])
