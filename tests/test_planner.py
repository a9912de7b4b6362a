"""plan_kv_cache: groups, bytes per block, block counts, tensors and refusals."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.model_files import load_model_file, preset_names
from kvcore.specs import (
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

F32 = torch.float32


def full(bs=16, heads=2, hs=64, dtype=F32, **kw):
    return FullAttentionSpec(bs, num_kv_heads=heads, head_size=hs, dtype=dtype, **kw)


def sliding(bs=16, heads=2, hs=64, dtype=F32, window=128, **kw):
    return SlidingWindowSpec(bs, num_kv_heads=heads, head_size=hs, dtype=dtype, sliding_window=window, **kw)


# ---------------------------------------------------------------- worked numbers


def test_two_fp32_layers_layer_compact():
    spec = full()
    assert spec.page_size_bytes == 16384
    config = plan_kv_cache({"l.0": spec, "l.1": spec}, "LBNHC", num_blocks=32)
    (tensor,) = config.kv_cache_tensors
    assert (tensor.size, tensor.layer_stride, tensor.block_stride) == (1_048_576, 524_288, 16_384)
    assert tensor.layers == ("l.0", "l.1") and tensor.offset == 0
    assert config.num_blocks == 32 and len(config.kv_cache_groups) == 1


def test_two_fp32_layers_block_outermost():
    spec = full()
    config = plan_kv_cache({"l.0": spec, "l.1": spec}, "BLHNC", num_blocks=32)
    (tensor,) = config.kv_cache_tensors
    assert (tensor.size, tensor.layer_stride, tensor.block_stride) == (1_048_576, 16_384, 32_768)


def test_full_and_sliding_equal_pages_overlay():
    page = full().page_size_bytes
    config = plan_kv_cache({"l.0": full(), "l.1": sliding()}, "LBNHC", available_memory=64 * page + 5)
    assert config.num_blocks == 64
    assert [g.layer_names for g in config.kv_cache_groups] == [["l.0"], ["l.1"]]
    sizes = {t.size for t in config.kv_cache_tensors}
    assert sizes == {64 * page} and all(t.offset == 0 for t in config.kv_cache_tensors)
    assert len(config.kv_cache_tensors) == 2


def test_sliding_with_half_page_doubles_its_block_size():
    config = plan_kv_cache({"l.0": full(), "l.1": sliding(heads=1)}, "BLNHC", num_blocks=8)
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    assert specs[0].block_size == 16 and specs[1].block_size == 32
    assert specs[1].page_size_bytes == specs[0].page_size_bytes == 16384
    assert specs[1].page_size_padded is None


def test_gemma_like_groups_split_by_smallest_type():
    specs = {
        f"model.layers.{i}.attn": (full() if i % 6 == 5 else sliding()) for i in range(60)
    }
    config = plan_kv_cache(specs, "LBNHC", num_blocks=4)
    groups = config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    assert kinds.count("FullAttentionSpec") == 1 and kinds.count("SlidingWindowSpec") == 5
    assert all(len(g.layer_names) == 10 for g in groups)
    order = list(specs)
    for g in groups:  # model order inside each group
        assert [order.index(n) for n in g.layer_names] == sorted(order.index(n) for n in g.layer_names)
    assert config.kv_cache_tensors[0].size == 4 * 10 * full().page_size_bytes


def test_mamba_and_non_dividing_attention_are_padded():
    mamba = MambaSpec(16, shapes=[(3, 100), (700,)], dtypes=[torch.float32] * 2)  # 4000 bytes
    attn = full(hs=16, heads=1)  # 16 * 32 * 4 = 2048 bytes
    big = full(hs=15, heads=2, bs=16)  # 2 * 16 * 120 = 3840 bytes
    config = plan_kv_cache({"a.0": attn, "m.1": mamba, "b.2": big}, "LBNHC", num_blocks=3)
    pages = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    assert pages == {4000}
    by_layer = {g.layer_names[0]: g.kv_cache_spec for g in config.kv_cache_groups}
    assert by_layer["a.0"].page_size_padded == 4000 and by_layer["a.0"].block_size == 16
    assert by_layer["b.2"].page_size_padded == 4000
    assert by_layer["m.1"] == mamba


def test_mla_that_does_not_divide_is_refused():
    mla = MLAAttentionSpec(16, num_kv_heads=1, head_size=24, dtype=F32)  # 1536 bytes
    with pytest.raises(ValueError, match=r"MLA layer 'x.1'.*1536-byte page.*cannot be padded"):
        plan_kv_cache({"x.0": full(), "x.1": mla}, "BLNHC", num_blocks=4)


def test_encoder_only_layers_get_a_group_but_no_tensor():
    enc = EncoderOnlyAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=F32)
    config = plan_kv_cache({"e.0": enc, "d.1": full(), "d.2": full()}, "LBNHC", num_blocks=4)
    assert [g.layer_names for g in config.kv_cache_groups] == [["d.1", "d.2"], ["e.0"]]
    assert [t.layers for t in config.kv_cache_tensors] == [("d.1", "d.2")]
    only = plan_kv_cache({"e.0": enc}, "LBNHC", available_memory=1 << 20)
    assert only.kv_cache_tensors == [] and only.kv_cache_groups[0].layer_names == ["e.0"]


@pytest.mark.parametrize("budget", [{"available_memory": 0}, {"available_memory": 1 << 30}, {"num_blocks": 7}])
def test_encoder_only_model_plans_a_usable_pool(budget):
    # regression (#14): an encoder-only model planned one block, which no block pool takes
    enc = EncoderOnlyAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=F32)
    config = plan_kv_cache({"e.0": enc, "e.1": enc}, "BLNHC", **budget)
    assert config.num_blocks == budget.get("num_blocks", 2)
    assert config.kv_cache_tensors == [] and allocate_kv_cache(config, "cpu") == {}


def test_no_memory_for_a_cached_model_says_what_one_block_needs():
    match = r"available_memory=0 B holds 0 KV cache blocks.*16 KiB \(16,384 bytes\).*32 KiB \(32,768 bytes\)"
    with pytest.raises(ValueError, match=match):
        plan_kv_cache({"l.0": full()}, "LBNHC", available_memory=0)


_F16 = torch.float16


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("num_blocks", [2, 4, 5, 7])
@pytest.mark.parametrize(
    "specs",
    [
        # the unified page (10 bytes of float16 state) must not leave float32 pages mid-element
        {"m": MambaSpec(1, [(5,)], [_F16]), "a": FullAttentionSpec(1, 1, 1, F32)},
        # a uniform-type group: the float32 tensor must not start after an odd number of halves
        {"m.0": MambaSpec(16, [(1,)], [_F16]), "m.1": MambaSpec(16, [(2,)], [F32])},
        # mixed element sizes inside one state: 6 bytes, padded to a multiple of 4
        {"m.0": MambaSpec(16, [(1,), (1,)], [F32, _F16]), "a.1": FullAttentionSpec(1, 1, 1, _F16)},
        {"m.0": MambaSpec(16, [(1,), (1,)], [F32, _F16]), "m.1": MambaSpec(16, [(1,), (1,)], [F32, _F16])},
    ],
    ids=["mamba-f16-and-f32-attention", "uniform-f16-f32-states", "mixed-state", "mixed-state-only"],
)
def test_mixed_element_sizes_plan_and_allocate_aligned(specs, layout, num_blocks):
    # regression (#14): these plans were accepted and then refused by allocate_kv_cache
    try:
        config = plan_kv_cache(specs, layout, num_blocks=num_blocks)
    except ValueError as exc:
        able = re.search(r"all that can: ([A-Z, ]+)\)$", str(exc))
        assert able, f"a refusal must name the layouts that can: {exc}"
        for name in able.group(1).split(", "):
            _check_views(plan_kv_cache(specs, name, num_blocks=num_blocks))
        return
    for tensor in config.kv_cache_tensors:
        group = config.group_of(tensor.layers[0])[1]
        align = group.spec_of(tensor.layers[0]).dtype_alignment
        assert tensor.offset % align == tensor.layer_stride % align == tensor.block_stride % align == 0
    views = allocate_kv_cache(config, "cpu")
    _check_views(config)
    for name, spec in specs.items():
        if isinstance(spec, MambaSpec):
            planned = config.group_of(name)[1].spec_of(name)
            states = planned.split_states(views[name])  # every state aligned to its dtype
            assert [s.dtype for s in states] == list(spec.dtypes)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_uniform_type_layers_of_different_shapes_share_one_group(layout):
    specs = {"l.0": full(heads=2), "l.1": full(heads=1), "l.2": full(heads=2)}
    config = plan_kv_cache(specs, layout, num_blocks=5)
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.layer_names == ["l.0", "l.1", "l.2"]
    assert config.kv_cache_tensors[0].size == 5 * (16384 * 2 + 8192)
    _check_views(config)


def test_layer_compact_refuses_groups_with_different_footprints():
    # padded attention page rounded up to its 8-token kernel page; Mamba is not
    attn = full(hs=32, heads=1, page_size_padded=5000, block_stride_alignment=MultipleOf(8))
    mamba = MambaSpec(16, shapes=[(1250,)], dtypes=[torch.float32])
    specs = {"a.0": attn, "m.1": mamba}
    refusal = r"need \[5000, 6144\] bytes; use a layout that can, such as BLNHC"
    with pytest.raises(ValueError, match=refusal):
        plan_kv_cache(specs, "LBNHC", num_blocks=4)
    config = plan_kv_cache(specs, "BLNHC", num_blocks=4)
    assert config.kv_cache_tensors[0].block_stride % 2048 == 0  # lcm with the kernel page
    _check_views(config)


def test_lhbnc_refuses_groups_that_split_blocks_differently():
    specs = {"a.0": full(heads=2), "m.1": MambaSpec(16, shapes=[(4096,)], dtypes=[F32])}
    with pytest.raises(ValueError, match="splits blocks by head.*can, such as LBNHC"):
        plan_kv_cache(specs, "LHBNC", num_blocks=4)
    _check_views(plan_kv_cache(specs, "LBNHC", num_blocks=4))


@pytest.mark.parametrize("layout, suggested", [("LHBNC", "LBNHC"), ("BHLNC", "BLNHC")])
def test_padded_multi_head_pages_need_a_block_compact_layout(layout, suggested):
    specs = {"a.0": full(heads=2, page_size_padded=20000)}
    refusal = rf"'a.0' cannot keep its 2-head page padded.*such as {suggested} \(all that can: "
    with pytest.raises(ValueError, match=refusal):
        plan_kv_cache(specs, layout, num_blocks=4)
    # the layout refusal wins over a budget that is also too small
    with pytest.raises(ValueError, match=refusal):
        plan_kv_cache(specs, layout, available_memory=100)


@pytest.mark.parametrize("memory", [0, 1, 700])
def test_padded_two_head_page_in_lhbnc_is_a_layout_error_not_a_budget_error(memory):
    # regression (hypothesis): 1- and 2-head layers plus a head-size-6 sliding
    # layer; the 2-head page is padded to 192 bytes, which LHBNC cannot express
    specs = {
        "m.0": full(bs=2, heads=1, hs=2),  # 32 bytes: its block size grows to 12
        "m.1": full(bs=2, heads=2, hs=4),  # 128 bytes: padded to 192
        "m.2": sliding(bs=4, heads=1, hs=6, window=4),  # 192 bytes
    }
    with pytest.raises(ValueError, match="LHBNC cannot hold.*'m.1'.*such as LBNHC") as exc:
        plan_kv_cache(specs, "LHBNC", available_memory=memory)
    assert "KV cache block" not in str(exc.value)
    _check_views(plan_kv_cache(specs, "LBNHC", num_blocks=2))


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC", "LBNHC", "LBHNC"])
def test_refusal_names_only_layouts_that_plan(layout):
    # regression (hypothesis): the padded 2-head page rules out LHBNC and
    # BHLNC, and the 2-token alignment rounds it to 576 bytes against the
    # other group's 512, which rules out the layer-compact layouts too
    specs = {
        "m.0": full(bs=4, heads=2, hs=6, block_stride_alignment=MultipleOf(2)),
        "m.1": sliding(bs=4, heads=2, hs=8, window=4),
    }
    with pytest.raises(ValueError, match=r"such as BLNHC \(all that can: BLNHC, BLHNC\)$"):
        plan_kv_cache(specs, layout, available_memory=0)
    for able in ("BLNHC", "BLHNC"):
        _check_views(plan_kv_cache(specs, able, num_blocks=2))


# ---------------------------------------------------------------- bad input


def test_budget_must_be_exactly_one():
    with pytest.raises(ValueError, match="exactly one of available_memory"):
        plan_kv_cache({"l.0": full()}, "LBNHC")
    with pytest.raises(ValueError, match="exactly one of available_memory"):
        plan_kv_cache({"l.0": full()}, "LBNHC", available_memory=1 << 20, num_blocks=3)


def test_too_little_memory_says_what_one_block_needs():
    match = r"holds 1 KV cache block.*needs 32 KiB \(32,768 bytes\).*64 KiB \(65,536 bytes\)"
    with pytest.raises(ValueError, match=match):
        plan_kv_cache({"l.0": full(), "l.1": full()}, "BLNHC", available_memory=65535)


@pytest.mark.parametrize(
    "specs, kwargs, error",
    [
        ({}, {"num_blocks": 2}, ValueError),
        ([("l.0", None)], {"num_blocks": 2}, TypeError),
        ({"l.0": "full"}, {"num_blocks": 2}, TypeError),
        ({"l.0": UniformTypeKVCacheSpecs(16, {"x": full()})}, {"num_blocks": 2}, TypeError),
        ({"l.0": full()}, {"num_blocks": 0}, ValueError),
        ({"l.0": full()}, {"available_memory": -1}, ValueError),
        ({"l.0": full()}, {"available_memory": 1.5e9}, TypeError),
    ],
)
def test_bad_input(specs, kwargs, error):
    with pytest.raises(error):
        plan_kv_cache(specs, "LBNHC", **kwargs)


def test_unknown_layout():
    with pytest.raises(ValueError, match="valid names"):
        plan_kv_cache({"l.0": full()}, "LNBHC", num_blocks=2)


# ---------------------------------------------------------------- properties


def _addresses(view: torch.Tensor, size: int) -> torch.Tensor:
    """Byte addresses of a layer view, shaped [B, bytes per block]."""
    raw = view.view(torch.int8)
    index = torch.arange(size).as_strided(raw.shape, raw.stride(), raw.storage_offset())
    return index.reshape(raw.shape[0], -1)


def _check_views(config):
    """Views never overlap within a group; across groups, block b meets only block b."""
    views = allocate_kv_cache(config, "cpu")
    size = config.kv_cache_tensors[0].size
    owners = []
    for group in config.kv_cache_groups:
        names = [n for n in group.layer_names if n in views]
        if not names:
            continue
        addrs = [_addresses(views[n], size) for n in names]
        flat = torch.cat([a.flatten() for a in addrs])
        assert int(torch.bincount(flat, minlength=size).max()) == 1
        owner = torch.full((size,), -1, dtype=torch.int64)
        for a in addrs:
            owner[a] = torch.arange(a.shape[0]).unsqueeze(1).expand_as(a)
        owners.append(owner)
    for i in range(len(owners)):
        for j in range(i):
            both = (owners[i] >= 0) & (owners[j] >= 0)
            assert torch.equal(owners[i][both], owners[j][both])


_DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def _layer_spec(draw):
    kind = draw(st.sampled_from(["full", "full", "sliding", "sliding", "mamba", "mla", "encoder"]))
    bs = draw(st.sampled_from([2, 4, 8]))
    heads = draw(st.integers(1, 2))
    hs = draw(st.sampled_from([2, 4, 6, 8]))
    dtype = draw(_DTYPES)
    # kernels of fixed sizes ask packed blocks to keep whole kernel blocks
    align = {"block_stride_alignment": draw(st.sampled_from([None, MultipleOf(1), MultipleOf(2)]))}
    if kind == "full":
        return full(bs, heads, hs, dtype, **align)
    if kind == "sliding":
        return sliding(bs, heads, hs, dtype, window=draw(st.sampled_from([4, 32])), **align)
    if kind == "mla":
        return MLAAttentionSpec(bs, num_kv_heads=1, head_size=hs, dtype=dtype)
    if kind == "encoder":
        return EncoderOnlyAttentionSpec(bs, num_kv_heads=heads, head_size=hs, dtype=dtype)
    return MambaSpec(bs, shapes=[(2 * draw(st.integers(1, 40)),)], dtypes=[dtype])


def _named_layouts(message: str) -> list[KVCacheLayout]:
    """The layouts a refusal says can plan the model (the suggestion first)."""
    match = re.search(r"such as (\w+) \(all that can: ([\w, ]+)\)$", message)
    assert match, message  # a refusal names a layout that can
    able = [KVCacheLayout[n] for n in match.group(2).split(", ")]
    assert able[0] is KVCacheLayout[match.group(1)]
    return able


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.lists(_layer_spec(), min_size=1, max_size=7),
    layout=st.sampled_from(list(KVCacheLayout)),
    memory=st.integers(1, 16).flatmap(lambda k: st.integers((k - 1) * 2500, k * 2500)),
)
def test_plan_properties(layers, layout, memory):
    specs = {f"model.layers.{i}.x": s for i, s in enumerate(layers)}
    try:
        config = plan_kv_cache(specs, layout, available_memory=memory)
    except ValueError as exc:
        message = str(exc)
        if "MLA layer" in message:  # no layout can pad MLA
            event("refused: MLA page")
            with pytest.raises(ValueError, match="MLA layer"):
                plan_kv_cache(specs, "BLNHC", num_blocks=2)
            return
        if re.search(r"holds \d+ KV cache blocks?;", message):  # budget too small: 2 blocks do not fit
            event("refused: budget")
            two = plan_kv_cache(specs, layout, num_blocks=2)
            assert two.kv_cache_tensors[0].size > memory
            return
        assert f"layout {layout.name} cannot hold" in message, message
        event("refused: layout")
        able = _named_layouts(message)
        for other in KVCacheLayout:  # exactly the named layouts plan the model
            if other in able:
                _check_views(plan_kv_cache(specs, other, num_blocks=2))
            else:
                with pytest.raises(ValueError, match=f"layout {other.name} cannot hold"):
                    plan_kv_cache(specs, other, num_blocks=2)
        return

    event(f"planned with {len(config.kv_cache_groups)} group(s)")
    order = list(specs)
    seen = [n for g in config.kv_cache_groups for n in g.layer_names]
    assert sorted(seen) == sorted(order)  # every layer in exactly one group
    for g in config.kv_cache_groups:
        assert g.layer_names == sorted(g.layer_names, key=order.index)
    cached = [n for n, s in specs.items() if not isinstance(s, EncoderOnlyAttentionSpec)]
    in_tensors = [n for t in config.kv_cache_tensors for n in t.layers]
    assert sorted(in_tensors) == sorted(cached)
    if not cached:
        return
    size = config.kv_cache_tensors[0].size
    assert all(t.size == size for t in config.kv_cache_tensors) and size <= memory
    assert size % config.num_blocks == 0
    more = plan_kv_cache(specs, layout, num_blocks=config.num_blocks + 1)
    assert more.kv_cache_tensors[0].size > memory  # num_blocks is the most that fits
    _check_views(config)


# ---------------------------------------------------------------- real shapes


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("preset", preset_names())
def test_presets_plan_or_name_a_layout_that_does(preset, layout, block_size):
    specs = load_model_file(preset, block_size=block_size).kv_cache_specs
    memory = 40 << 30
    try:
        config = plan_kv_cache(specs, layout, available_memory=memory)
    except ValueError as exc:
        able = _named_layouts(str(exc))
        assert layout not in able and able
        for other in able:
            config = plan_kv_cache(specs, other, available_memory=memory)
            assert config.layout is other and config.num_blocks >= 2
        return
    size = config.kv_cache_tensors[0].size
    assert config.num_blocks >= 2 and memory - size < size // config.num_blocks
    assert sorted(n for t in config.kv_cache_tensors for n in t.layers) == sorted(specs)


def test_presets_cover_both_outcomes():
    jamba = load_model_file("jamba-1.5-mini", block_size=16).kv_cache_specs
    with pytest.raises(ValueError, match="'model.layers.4.self_attn' cannot keep its 8-head page"):
        plan_kv_cache(jamba, "BHLNC", num_blocks=2)
    assert plan_kv_cache(jamba, "BLNHC", num_blocks=2).num_blocks == 2
