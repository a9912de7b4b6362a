"""Separate state pages: state caches in a region of their own at the start of the one allocation,
with their own page size, block ids and pool; the other layers keep their natural blocks after it.
Views stay inside the allocation and the two regions never share a byte, in every layout; both
pools hand out, zero, describe and transfer their own blocks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore import FullAttentionSpec, KVCache, KVCacheLayout, MambaSpec, SlidingWindowSpec, plan_kv_cache
from kvcore.memory.planner import REGION_ALIGNMENT
from kvcore.memory.views import allocate_kv_cache
from kvcore.transfer import HostKVPool, describe, plan_transfer
from kvcore.transfer.descriptor import KVCacheDescriptor
from kvcore_torch.backend import TorchAttentionBackend

LAYOUTS = [layout.name for layout in KVCacheLayout]


def hybrid_specs(heads=2, head_size=8, block_size=16, state=((3, 4, 8), (40, 4)), pattern="MMAMSA",
                 dtypes=(torch.float32, torch.float16)):
    """M: a mixer, A: full attention, S: sliding-window attention."""
    out = {}
    for i, kind in enumerate(pattern):
        if kind == "M":
            out[f"layers.{i}.mixer"] = MambaSpec(block_size, list(state), list(dtypes), mamba_type="mamba2")
        elif kind == "A":
            out[f"layers.{i}.attn"] = FullAttentionSpec(block_size, heads, head_size, torch.float16)
        else:
            out[f"layers.{i}.attn"] = SlidingWindowSpec(block_size, heads, head_size, torch.float16,
                                                        sliding_window=24)
    return out


def byte_offsets(view: torch.Tensor, base: int, size: int, first_row: int, rows: int) -> torch.Tensor:
    """Every byte (from the allocation's start) that rows ``[first_row, first_row + rows)`` of
    ``view`` address."""
    item = view.element_size()
    sub = view[first_row : first_row + rows]
    strides = tuple(s * item for s in sub.stride())
    offset = sub.data_ptr() - base
    return torch.arange(size).as_strided((*sub.shape, item), (*strides, 1), offset).reshape(-1)


def owners(config, views):
    """Per region (True: the state region), per group, per (layer, block): its bytes."""
    base = next(iter(views.values())).untyped_storage().data_ptr()
    size = config.kv_cache_tensors[0].size
    out = {}
    for gid, group in enumerate(config.kv_cache_groups):
        blocks = config.num_state_blocks if config.in_state_region(gid) else config.num_blocks
        for name in group.layer_names:
            rows = views[name].shape[0] // blocks
            for block in range(blocks):
                out[(config.in_state_region(gid), gid, name, block)] = byte_offsets(
                    views[name], base, size, block * rows, rows
                )
    return out, size


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS), heads=st.integers(1, 3), head_size=st.sampled_from([4, 8]),
    block_size=st.sampled_from([1, 4, 16]), state_dim=st.integers(1, 9), kernel=st.integers(2, 4),
    pattern=st.sampled_from(["MA", "MMAM", "AMMSA", "MAMAMM"]), num_blocks=st.integers(2, 5),
    num_state_blocks=st.integers(2, 5), mixed=st.booleans(),
)
def test_regions_never_share_a_byte_and_views_stay_inside_the_allocation(
    layout, heads, head_size, block_size, state_dim, kernel, pattern, num_blocks, num_state_blocks, mixed
):
    dtypes = (torch.float32, torch.float16) if mixed else (torch.float32, torch.float32)
    specs = hybrid_specs(heads, head_size, block_size, ((2, state_dim, 3), (state_dim + 5, kernel)), pattern,
                         dtypes)
    try:
        config = plan_kv_cache(specs, layout, num_blocks=num_blocks, separate_state_pages=True,
                               num_state_blocks=num_state_blocks)
    except ValueError as exc:  # NOTE: the attention groups' own layout limits, as without states
        assert "cannot hold this model's pages" in str(exc)
        plan_kv_cache({n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}, "LBNHC", num_blocks=2)
        with pytest.raises(ValueError, match="cannot hold this model's pages"):
            plan_kv_cache({n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}, layout, num_blocks=2)
        return
    views = allocate_kv_cache(config, "cpu")
    assert set(views) == set(specs)
    state_groups = [g for i, g in enumerate(config.kv_cache_groups) if config.in_state_region(i)]
    assert [n for g in state_groups for n in g.layer_names] == [n for n in specs if "mixer" in n]
    assert len(state_groups) == 1  # NOTE: one state spec: one group, one slot per sequence
    for name, view in views.items():
        spec = specs[name]
        assert view.shape[0] == (num_state_blocks if isinstance(spec, MambaSpec) else num_blocks * (
            view.shape[0] // num_blocks))
        if isinstance(spec, MambaSpec):  # NOTE: the state's natural page, not one unified with attention
            assert view.shape[-1] * view.element_size() == spec.real_page_size_bytes
    found, size = owners(config, views)
    state = torch.cat([b for (region, *_), b in found.items() if region])
    other = torch.cat([b for (region, *_), b in found.items() if not region])
    region = min(t.offset for t in config.kv_cache_tensors if config.num_blocks_of(t) == num_blocks
                 and not config.in_state_region(config.group_of(t.layers[0])[0]))
    assert region % REGION_ALIGNMENT == 0 and int(state.max()) < region <= int(other.min())
    assert int(other.max()) < size
    for gid in range(len(config.kv_cache_groups)):
        mine = torch.cat([b for (_, g, *_), b in found.items() if g == gid])
        assert mine.unique().numel() == mine.numel(), f"group {gid}: two (layer, block) pairs share a byte"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_available_memory_sizes_the_attention_pool_after_the_state_region(layout):
    specs = hybrid_specs(pattern="MMAMA")
    plain = plan_kv_cache({n: s for n, s in specs.items() if "attn" in n}, layout, num_blocks=2)
    per_block = plain.kv_cache_tensors[0].size // 2
    config = plan_kv_cache(specs, layout, available_memory=1 << 20, separate_state_pages=True,
                           num_state_blocks=9)
    region = config.kv_cache_tensors[0].size - per_block * config.num_blocks
    assert region == -(-9 * 3 * specs["layers.0.mixer"].page_size_bytes // REGION_ALIGNMENT) * REGION_ALIGNMENT
    assert config.num_blocks == ((1 << 20) - region) // per_block
    assert config.sequence_capacity(17) == min((config.num_blocks - 1) // 2, 8)
    with pytest.raises(ValueError, match=r"after the .* state region.*plan with at least"):
        plan_kv_cache(specs, layout, available_memory=region + per_block, separate_state_pages=True,
                      num_state_blocks=9)


def test_the_default_plan_is_the_unified_one():
    specs = hybrid_specs()
    unified = plan_kv_cache(specs, "LBNHC", num_blocks=6)
    assert unified == plan_kv_cache(specs, "LBNHC", num_blocks=6, separate_state_pages=False)
    assert unified.num_state_blocks is None and not unified.separate_state_pages
    assert all(unified.num_blocks_of(t) == 6 for t in unified.kv_cache_tensors)
    assert len(unified.kv_cache_groups) > 2  # NOTE: state layers split to the attention groups' size


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_state_blocks": 4}, ValueError, "pass separate_state_pages=True"),
        ({"separate_state_pages": True}, ValueError, "separate_state_pages=True needs num_state_blocks"),
        ({"separate_state_pages": True, "num_state_blocks": 1}, ValueError, "num_state_blocks=1 leaves no state slot"),
        ({"separate_state_pages": "yes"}, TypeError, "separate_state_pages must be True or False"),
    ],
)
def test_bad_state_region_options_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan_kv_cache(hybrid_specs(), "LBNHC", num_blocks=4, **kwargs)


def test_a_model_of_state_caches_alone_keeps_the_unified_plan():
    specs = {n: s for n, s in hybrid_specs().items() if "mixer" in n}
    with pytest.raises(ValueError, match="need state caches and at least one layer beside them"):
        plan_kv_cache(specs, "LBNHC", num_blocks=4, separate_state_pages=True, num_state_blocks=3)


def make_cache(layout="LBNHC", **kwargs):
    specs = hybrid_specs(pattern="MMAMA")
    backends = {n: TorchAttentionBackend for n in specs if "attn" in n}
    return KVCache.create(specs, backends, device="cpu", layout=layout, max_num_seqs=3, max_model_len=64,
                          **{"num_blocks": 6, "separate_state_pages": True, **kwargs})


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_both_pools_hand_out_and_zero_their_own_blocks(layout):
    kv = make_cache(layout)
    assert kv.state_pool.num_blocks == 4 and kv.block_pool.num_blocks == 6  # NOTE: max_num_seqs + 1
    assert kv.pool_of(0) is kv.block_pool and kv.pool_of(1) is kv.state_pool
    raw = next(iter(kv.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(raw.untyped_storage())
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8))
    before = raw.clone()
    attn, state = kv.block_pool.allocate(2), kv.state_pool.allocate(1)
    assert kv.begin_step() == [*attn, *state]
    touched = torch.zeros_like(raw, dtype=torch.bool)
    base = raw.data_ptr()
    for name, view in kv.kv_caches.items():
        ids = state if "mixer" in name else attn
        for block in ids:
            where = byte_offsets(view, base, raw.numel(), block, 1)
            assert not raw[where].any(), name
            touched[where] = True
    assert torch.equal(raw[~touched], before[~touched])  # NOTE: no other block, either region
    assert kv.begin_step() == []


def test_create_defaults_to_the_unified_plan_and_one_pool():
    specs = hybrid_specs(pattern="MMAMA")
    kv = KVCache.create(specs, {n: "torch" for n in specs if "attn" in n}, device="cpu", num_blocks=6,
                        max_num_seqs=3, max_model_len=64)
    assert kv.state_pool is None and kv.state_zeroer is None and not kv.config.separate_state_pages
    assert kv.pool_of(1) is kv.block_pool
    with pytest.raises(ValueError, match="pass separate_state_pages=True with it"):
        KVCache.create(specs, {n: "torch" for n in specs if "attn" in n}, device="cpu", num_blocks=6,
                       max_num_seqs=3, max_model_len=64, num_state_blocks=5)


def test_elastic_resize_grows_the_attention_pool_and_keeps_the_state_region():
    kv = make_cache("BLNHC", num_blocks=3, max_num_blocks=12, num_state_blocks=5)
    states = {n: (v.data_ptr(), v.clone()) for n, v in kv.kv_caches.items() if "mixer" in n}
    slot = kv.state_pool.allocate(1)[0]
    kv.begin_step()
    kv.kv_caches["layers.0.mixer"][slot].fill_(7)
    kv.resize(12)
    assert kv.block_pool.num_blocks == 12 and kv.state_pool.num_blocks == 5
    assert all(kv.kv_caches[n].data_ptr() == ptr for n, (ptr, _) in states.items())
    assert bool((kv.kv_caches["layers.0.mixer"][slot] == 7).all())
    ids = kv.block_pool.allocate(11)
    kv.begin_step()
    for name, view in kv.kv_caches.items():
        if "attn" in name:
            view[ids].fill_(1)  # NOTE: every grown block is backed
    kv.block_pool.free(ids)
    kv.resize(3)
    assert bool((kv.kv_caches["layers.0.mixer"][slot] == 7).all())


def test_descriptors_plan_transfers_and_the_host_tier_cover_the_state_region():
    kv = make_cache("BLNHC", num_state_blocks=5)
    descriptor = describe(kv)
    assert KVCacheDescriptor.from_json(descriptor.to_json()) == descriptor
    state_group = next(g for g in descriptor.groups if g.num_blocks is not None)
    assert state_group.num_blocks == 5 and descriptor.num_blocks == 6
    assert descriptor.num_blocks_of(state_group.group_id) == 5
    raw = torch.empty(0, dtype=torch.int8).set_(next(iter(kv.kv_caches.values())).untyped_storage())
    want = torch.cat([byte_offsets(kv.kv_caches[n], raw.data_ptr(), raw.numel(), 4, 1)
                      for n in state_group.layer_names]).sort().values
    regions = plan_transfer(descriptor, [4], group_id=state_group.group_id)
    got = torch.cat([torch.arange(r.offset, r.end) for r in regions])
    assert torch.equal(got, want) and len(regions) == 1  # NOTE: block-outermost: one run per block
    with pytest.raises(ValueError, match=r"block id 5 is not an integer in \[1, 5\)"):
        plan_transfer(descriptor, [5], group_id=state_group.group_id)
    pool = HostKVPool(kv, 2)
    view = kv.kv_caches["layers.0.mixer"]
    view[4].copy_(torch.randn(view[4].shape).to(view.dtype))
    saved = view[4].clone()
    pool.offload([4], [1], group_id=state_group.group_id)
    view[4].zero_()
    pool.restore([1], [3], group_id=state_group.group_id)
    assert torch.equal(view[3], saved)


def test_kvcore_plan_shows_both_regions(tmp_path):
    model = tmp_path / "hybrid.toml"
    model.write_text(
        'name = "tiny hybrid"\nnum_layers = 8\nblock_size = 16\nseparate_state_pages = true\n'
        'num_state_blocks = 65\npattern = ["mamba", "mamba", "mamba", "attn"]\n'
        '[types.attn]\nkind = "full"\nnum_kv_heads = 2\nhead_size = 64\ndtype = "bfloat16"\n'
        '[types.mamba]\nkind = "mamba"\nshapes = [[8, 64, 16], [544, 4]]\ndtypes = ["float32", "bfloat16"]\n'
    )
    run = [sys.executable, "-m", "kvcore", "plan", str(model), "--memory", "64MiB"]
    text = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "state region:" in text and "65 blocks of its own (64 usable)" in text
    summary = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    state = 6 * (8 * 64 * 16 * 4 + 544 * 4 * 2)
    assert summary["num_state_blocks"] == 65
    assert summary["state_region_bytes"] == -(-65 * state // REGION_ALIGNMENT) * REGION_ALIGNMENT
    assert summary["bytes_per_block"] == 2 * 16 * 2 * 128 * 2  # NOTE: attention's natural 16-token page
    assert [g["in_state_region"] for g in summary["groups"]] == [False, True]
