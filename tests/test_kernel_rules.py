"""KernelRequirements in KVCache.create, and what a customize hook may change (only padding and alignment).

Each test registers fake backends in-process on a fresh manager; the plans
are tiny (6 blocks of 16 tokens) and the views are checked over a meta
buffer before anything is allocated.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
import torch
from _plugin_dists import clean_plugin_env, make_backend  # noqa: F401

import kvcore
from kvcore import FullAttentionSpec, KernelRequirements, KVCache, KVCacheLayout, MultipleOf
from kvcore.errors import KernelRequirementError, PluginError
from kvcore.plugins.health import check_plugins

# NOTE: what "auto" picks depends on the backends installed: only this repository's load.
pytestmark = pytest.mark.usefixtures("own_plugins")

RULED = make_backend("ruled")
SPEC = FullAttentionSpec(16, 2, 8, torch.float16)  # page: 16 tokens x 2 heads x 16 fp16 = 512 elements


class Rules:
    """One backend with stated requirements, layouts and sizes; counts the requirement calls."""

    def __init__(self, requirements, layouts=None, sizes=None, customize=None):
        self.req, self.layouts, self.sizes, self.customize = requirements, layouts, sizes, customize
        self.calls = Counter()

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(RULED)

    @kvcore.hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        if backend is not RULED:
            return None
        self.calls[spec] += 1
        return self.req

    @kvcore.hookimpl
    def kvcore_supported_layouts(self, backend, spec):
        return self.layouts if backend is RULED else None

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return self.sizes if backend is RULED else None

    @kvcore.hookimpl
    def kvcore_customize_spec(self, backend, spec):
        return self.customize(spec) if backend is RULED and self.customize else None


def manager(plugin, name="rules"):
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(plugin, name=name)
    return pm


def create(pm, specs, backend="ruled", **kwargs):
    kwargs.setdefault("num_blocks", 6)
    return KVCache.create(specs, dict.fromkeys(specs, backend), device="cpu", max_num_seqs=2,
                          max_model_len=64, plugin_manager=pm, **kwargs)


LAYERS = {f"l{i}": SPEC for i in range(4)}


def test_layout_resolution_skips_layouts_whose_strides_break_the_limit():
    # BLNHC puts 4 layers' pages (2048 elements) between blocks; LBNHC one page (512).
    plugin = Rules(KernelRequirements(max_stride_elements=1024), layouts=["BLNHC", "LBNHC"])
    pm = manager(plugin)
    kv = create(pm, LAYERS)
    assert kv.layout is KVCacheLayout.LBNHC
    assert max(max(v.stride()) for v in kv.layer_kv_caches.values()) < 1024
    # Every layer's requirement was asked once for its one distinct (backend, spec).
    assert sum(plugin.calls.values()) == 1
    # The answer is kept in the negotiation record.
    assert {e.requirements for g in kv.negotiation.groups for e in g.backends} == {plugin.req}


def test_explicit_layout_breaking_a_rule_is_refused_with_a_layout_that_meets_it():
    pm = manager(Rules(KernelRequirements(max_stride_elements=1024), layouts=["BLNHC", "LBNHC"]))
    with pytest.raises(KernelRequirementError) as info:
        create(pm, LAYERS, layout="BLNHC")
    text = str(info.value)
    for words in ("'ruled'", "'l0'", "BLNHC", "max_stride_elements", "2048", "layout LBNHC meets every rule"):
        assert words in text
    assert isinstance(info.value, ValueError)


def test_no_layout_meeting_a_rule_names_a_block_size_that_does():
    # Every layout puts at least one 512-element page between blocks; 8-token pages (256) fit.
    pm = manager(Rules(KernelRequirements(max_stride_elements=400)))
    with pytest.raises(KernelRequirementError, match="no layout of .*max_stride_elements.*8-token blocks in layout"):
        create(pm, {"l0": SPEC})


def test_alignment_of_non_last_strides_and_view_offsets():
    # Rows of 16 fp16 are 32 bytes: every layout has a 32-byte stride somewhere.
    pm = manager(Rules(KernelRequirements(alignment_bytes=4096)))
    with pytest.raises(KernelRequirementError, match="alignment_bytes.*no layout or block size tried meets it"):
        create(pm, {"l0": SPEC, "l1": SPEC})
    # 32-byte alignment holds in LBHNC for strides, and layer offsets are whole blocks.
    pm = manager(Rules(KernelRequirements(alignment_bytes=32), layouts=["LBHNC"]))
    kv = create(pm, {"l0": SPEC, "l1": SPEC})
    for view in kv.layer_kv_caches.values():
        assert all(s * 2 % 32 == 0 for s in view.stride()[:-1]) and view.storage_offset() * 2 % 32 == 0


def test_offsets_are_checked_too():
    req = KernelRequirements(alignment_bytes=4096)
    assert req.view_violation([2048, 2048, 2048, 1], 2, 8192) is None
    assert req.view_violation([2048, 2048, 2048, 1], 2, 6144) == (
        "alignment_bytes", 6144, "view offsets in multiples of 4096 bytes")


def test_device_dtype_and_head_size_are_checked_before_allocating():
    pm = manager(Rules(KernelRequirements(devices=("cuda",))))
    with pytest.raises(KernelRequirementError, match="'ruled' cannot serve layer 'l0'.*cuda only.*devices"):
        create(pm, {"l0": SPEC})
    pm = manager(Rules(KernelRequirements(head_sizes=(64, 128))))
    with pytest.raises(KernelRequirementError, match="head sizes .64, 128., not 8"):
        create(pm, {"l0": SPEC})
    pm = manager(Rules(KernelRequirements(dtypes=(torch.bfloat16,))))
    with pytest.raises(KernelRequirementError, match="float16.*dtypes"):
        create(pm, {"l0": SPEC})


def test_auto_picks_the_backend_per_layer():
    pm = kvcore.get_plugin_manager()
    kv = create(pm, {"l0": SPEC, "l1": SPEC}, backend="auto")
    assert {g.backend.name for g in kv.attn_groups[0]} == {"torch"}
    # A backend that runs on the CPU and wants to beats the torch fallback.

    class Eager(Rules):
        @kvcore.hookimpl
        def kvcore_backend_priority(self, backend, spec, device):
            return 5 if backend is RULED else None

    pm.register(Eager(None), name="eager")
    kv = create(pm, {"l0": SPEC}, backend="auto")
    assert kv.attn_groups[0][0].backend is RULED


@pytest.mark.parametrize("field, change", [
    ("block_size", {"block_size": 32}),
    ("dtype", {"dtype": torch.bfloat16}),
    ("num_kv_heads", {"num_kv_heads": 4}),
    ("head_size", {"head_size": 16}),
])
def test_customize_may_not_change_what_a_layer_stores(field, change):
    pm = manager(Rules(None, customize=lambda spec: attrs.evolve(spec, **change)), name="greedy")
    with pytest.raises(PluginError, match=f"greedy.*backend 'ruled'.*changed {field}.*kvcore_customize_spec"):
        create(pm, {"l0": SPEC})


def test_customize_may_not_change_the_spec_class():
    def slide(spec):
        return kvcore.SlidingWindowSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                                        sliding_window=8)

    pm = manager(Rules(None, customize=slide), name="classy")
    with pytest.raises(PluginError, match="classy.*changed the spec class from FullAttentionSpec to SlidingWindowSpec"):
        create(pm, {"l0": SPEC})


def test_customize_may_pad_and_align():
    def pad(spec):
        return attrs.evolve(spec, num_head_slots=3, block_stride_alignment=kvcore.MultipleOf(4))

    pm = manager(Rules(None, customize=pad))
    kv = create(pm, {"l0": SPEC})
    assert kv.attn_groups[0][0].kv_cache_spec.num_head_slots == 3
    assert kv.layer_kv_caches["l0"].shape[1] == 3


def test_a_page_padded_by_the_hook_is_not_blamed_on_the_layout():
    def pad(spec):
        return attrs.evolve(spec, page_size_padded=spec.real_page_size_bytes + 64)

    pm = manager(Rules(None, layouts=["LBNHC"], sizes=[8], customize=pad))
    with pytest.raises(ValueError) as info:
        create(pm, {"l0": SPEC, "l1": SPEC})
    text = str(info.value)
    assert "backend 'ruled'" in text and "padded" in text and "manager block size of 8" in text
    assert "layer-compact" not in text


def test_an_empty_size_list_is_a_plugin_error_and_unhealthy():
    pm = manager(Rules(None, sizes=[]), name="empty")
    with pytest.raises(PluginError, match="empty.*empty list.*kvcore_supported_kernel_block_sizes"):
        create(pm, {"l0": SPEC})
    (info,) = [i for i in check_plugins(pm) if i.name == "empty"]
    assert info.status == "unhealthy" and "kvcore_supported_kernel_block_sizes" in info.error


@pytest.mark.parametrize("value", [5, None, "spec"])
def test_a_layer_spec_that_is_no_spec_names_the_layer(value):
    with pytest.raises(TypeError, match=f"layer_specs\\['l0'\\] is {value!r}.*not a KVCacheSpec") as info:
        KVCache.create({"l0": value}, {"l0": "torch"}, device="cpu", num_blocks=4, max_num_seqs=1, max_model_len=16)
    assert "CoreDefaults" not in str(info.value) and "plugin" not in str(info.value)


def test_a_backend_that_is_no_backend_names_the_layer():
    with pytest.raises(TypeError, match="layer_backends\\['l0'\\] is None.*'auto'"):
        KVCache.create({"l0": SPEC}, {"l0": None}, device="cpu", num_blocks=4, max_num_seqs=1, max_model_len=16)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcore.plugins.rules import kernel_views  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(list(KVCacheLayout)),
    block=st.sampled_from([16, 32, 64]),
    sizes=st.sampled_from([[16], [MultipleOf(1)], [8, 16]]),
    tokens_per_state=st.sampled_from([1, 4]),
    layers=st.integers(1, 3),
)
def test_the_views_checked_are_the_views_allocated(layout, block, sizes, tokens_per_state, layers):
    """What the rules are checked on (meta views from the plan) is what kernels get."""
    spec = (kvcore.MLAAttentionSpec(block, 1, 8, torch.float16, tokens_per_state=tokens_per_state)
            if tokens_per_state > 1 else FullAttentionSpec(block, 2, 8, torch.float16))
    specs = {f"l{i}": spec for i in range(layers)}
    pm = manager(Rules(KernelRequirements(max_stride_elements=2**40), sizes=sizes))
    try:
        kv = create(pm, specs, layout=layout, num_blocks=3)
    except ValueError:
        return  # a packed split this layout cannot hold: refused before allocating
    checked = kernel_views(kv.config, kv.negotiation.groups)
    for name, view in kv.layer_kv_caches.items():
        assert (checked[name].shape, checked[name].stride()) == (view.shape, view.stride())
        assert checked[name].storage_offset() == view.storage_offset()


def test_a_refused_layout_is_kept_with_its_reason_and_explained():
    pm = manager(Rules(KernelRequirements(max_stride_elements=1024), layouts=["BLNHC", "LBNHC"]))
    negotiation = kvcore.negotiate(LAYERS, dict.fromkeys(LAYERS, "ruled"), device="cpu", num_blocks=6,
                                   max_num_seqs=2, max_model_len=64, plugin_manager=pm)
    refused, chosen = negotiation.candidates
    assert (refused.layout, chosen.layout, negotiation.layout) == (KVCacheLayout.BLNHC, KVCacheLayout.LBNHC,
                                                                   KVCacheLayout.LBNHC)
    assert "rule max_stride_elements needs every stride below 1024 elements, got 2048" in refused.refusal
    assert chosen.refusal is None and chosen.config == negotiation.config
    text = negotiation.explain()
    assert "layout LBNHC: the first candidate that meets every kernel rule" in text
    assert f"BLNHC: {refused.refusal}" in text and "LBNHC: meets every rule" in text
