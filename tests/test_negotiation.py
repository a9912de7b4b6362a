"""The negotiation contract: hooks asked once, one record read by every stage.

Invariant: in one ``KVCache.create`` each hook runs at most once per distinct
(backend, spec); the plan, the views, the attention groups and the metadata
builders all hold the one customized spec; the kernel block table and the
kernel view of a group come from one decision, so every kernel block a table
names lies inside the manager block it was mapped from.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
import torch
from _plugin_dists import clean_plugin_env, make_backend  # noqa: F401

import kvcore
from kvcore import FullAttentionSpec, KVCache, MultipleOf

COUNTED = make_backend("counted")
# NOTE: kvcore-triton requires CUDA unless the Triton interpreter is on (conftest.py sets it without CUDA).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class CountingPlugin:
    """Fixed 16-token kernels, two layouts, and a customize hook that adds a head slot per call."""

    def __init__(self):
        self.calls = Counter()

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(COUNTED)

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        if backend is not COUNTED:
            return None
        self.calls["sizes"] += 1
        return [16]

    @kvcore.hookimpl
    def kvcore_supported_layouts(self, backend, spec):
        if backend is not COUNTED:
            return None
        self.calls["layouts"] += 1
        return ["LBHNC", "LBNHC"]

    @kvcore.hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        if backend is not COUNTED:
            return None
        self.calls["requirements"] += 1
        # NOTE: a stride limit makes KVCache.create check (and try) the layouts' kernel views.
        return kvcore.KernelRequirements(max_stride_elements=2**31, alignment_bytes=4)

    @kvcore.hookimpl
    def kvcore_customize_spec(self, backend, spec):
        if backend is not COUNTED:
            return None
        self.calls["customize"] += 1
        # NOTE: not idempotent on purpose: customizing twice would add two slots.
        return attrs.evolve(spec, num_head_slots=spec.num_heads + 1)


@pytest.fixture
def counting():
    pm = kvcore.get_plugin_manager(autoload=False)
    plugin = CountingPlugin()
    pm.register(plugin, name="counting")
    return pm, plugin


def _create(pm, specs, **kwargs):
    kwargs.setdefault("num_blocks", 6)
    return KVCache.create(specs, dict.fromkeys(specs, "counted"), device="cpu", max_num_seqs=2,
                          max_model_len=128, plugin_manager=pm, **kwargs)


def test_eight_identical_layers_ask_each_hook_once(counting):
    pm, plugin = counting
    specs = {f"layers.{i}.attn": FullAttentionSpec(32, 2, 8, torch.float32) for i in range(8)}
    kv = _create(pm, specs)
    assert plugin.calls == {"customize": 1, "sizes": 1, "layouts": 1, "requirements": 1}
    assert kv.kernel_block_sizes == [16] and kv.layout is kvcore.KVCacheLayout.LBHNC
    # two distinct specs: each hook once per (backend, spec)
    plugin.calls.clear()
    specs = {f"layers.{i}.attn": FullAttentionSpec(32, 2 + i % 2, 8, torch.float32) for i in range(8)}
    _create(pm, specs)
    assert plugin.calls == {"customize": 2, "sizes": 2, "layouts": 2, "requirements": 2}


def test_a_non_idempotent_customize_hook_gives_one_spec_everywhere(counting):
    pm, _ = counting
    specs = {f"layers.{i}.attn": FullAttentionSpec(32, 2, 8, torch.float32) for i in range(3)}
    kv = _create(pm, specs)
    planned = kv.config.kv_cache_groups[0].kv_cache_spec
    assert planned.num_heads == 3 and planned.block_stride_alignment == MultipleOf(16)
    (group,) = kv.attn_groups[0]
    assert group.kv_cache_spec == planned
    builder = group.get_metadata_builder()
    assert builder.kv_cache_spec == planned.copy_with_new_block_size(16)
    for name in specs:
        assert kv.kv_caches[name].shape == kv.layer_kv_caches[name].shape == (6 * 2, 3, 16, 16)
    # the zeroer covers exactly the planned pages: 3 layers x 3 heads x 32 tokens x 16 floats
    assert kv.zeroer.bytes_per_block == 3 * planned.page_size_bytes
    record = kv.negotiation.groups[0]
    assert (record.kernel_block_size, record.ratio, record.kv_cache_spec) == (16, 2, planned)
    assert record.backends[0].kv_cache_spec == planned


def test_metadata_builders_read_the_record_not_the_hooks(counting):
    pm, plugin = counting
    specs = {"a": FullAttentionSpec(32, 2, 8, torch.float32)}
    kv = _create(pm, specs)
    plugin.calls.clear()
    group = kv.group_of("a")
    group.create_metadata_builders("cpu", max_num_seqs=2, max_model_len=128, kernel_block_size=16)
    assert plugin.calls == {}
    assert group.kernel_block_size == 16
    with pytest.raises(ValueError, match="negotiated with kernel block size 16, not 8"):
        group.create_metadata_builders("cpu", max_num_seqs=2, max_model_len=128, kernel_block_size=8)


def _span(view: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses a view touches."""
    last = sum((n - 1) * s for n, s in zip(view.shape, view.stride()))
    return view.data_ptr(), view.data_ptr() + (last + 1) * view.element_size()


def assert_tables_match_views(kv: KVCache, name: str) -> None:
    """Every kernel block the table gives manager block b lies inside b's bytes."""
    group = kv.group_of(name)
    rows = kv.negotiation.rows_per_block()[name]
    allocated, kernel = kv.kv_caches[name], kv.layer_kv_caches[name]
    for b in range(kv.num_blocks):
        start, _ = _span(allocated[b * rows])
        _, end = _span(allocated[b * rows + rows - 1])
        table = group.map_to_kernel_block_table(torch.tensor([[b]], dtype=torch.int32, device=kv.device))
        for k in table[0].tolist():
            assert 0 <= k < kernel.shape[0], (name, b, k)
            lo, hi = _span(kernel[k])
            assert start <= lo and hi <= end, (name, b, k)


@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC", "BLNHC"])
def test_one_state_per_block_splits_neither_table_nor_view(layout):
    """Issue 14.1: tokens_per_state=0 under a fixed-size kernel keeps whole blocks in both."""
    spec = FullAttentionSpec(128, 1, 64, torch.bfloat16, tokens_per_state=0)
    specs = {"l0": spec, "l1": spec}
    kv = KVCache.create(specs, dict.fromkeys(specs, "triton"), device=TRITON_DEVICE, layout=layout,
                        num_blocks=4, max_num_seqs=2, max_model_len=512, plugin_manager=kvcore.get_plugin_manager())
    group = kv.group_of("l0")
    assert group.kernel_block_size is None
    assert group.map_to_kernel_block_table(torch.tensor([[3]], dtype=torch.int32)).tolist() == [[3]]
    assert kv.layer_kv_caches["l0"].shape == (4, 1, 1, 128)
    for name in specs:
        assert_tables_match_views(kv, name)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "BLHNC"])
def test_compressed_and_dense_groups_keep_tables_inside_their_blocks(layout):
    """A dense split (at allocation) and a packed split (kernel view) both agree with their tables."""
    specs = {f"m{i}": kvcore.MLAAttentionSpec(128, 1, 16, torch.float32, tokens_per_state=4) for i in range(3)}
    kv = KVCache.create(specs, dict.fromkeys(specs, "triton"), device=TRITON_DEVICE, layout=layout,
                        num_blocks=5, max_num_seqs=2, max_model_len=256, plugin_manager=kvcore.get_plugin_manager())
    group = kv.group_of("m0")
    assert group.kernel_block_size == 64
    packed = kv.negotiation.groups[0].ratio == 1
    assert packed == kvcore.KVCacheLayout.parse(layout).is_block_outermost
    assert (group.kernel_block_stride > 0) is packed
    for name in specs:
        assert_tables_match_views(kv, name)


def test_negotiate_decides_what_create_allocates_and_says_why(counting):
    pm, plugin = counting
    specs = {f"layers.{i}.attn": FullAttentionSpec(32, 2, 8, torch.float32) for i in range(4)}
    negotiation = kvcore.negotiate(specs, dict.fromkeys(specs, "counted"), device="cpu", num_blocks=6,
                                   max_num_seqs=2, max_model_len=128, plugin_manager=pm)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        negotiation.layout = kvcore.KVCacheLayout.LBNHC
    kv = _create(pm, specs)
    assert (negotiation.layout, negotiation.kernel_block_sizes) == (kv.layout, kv.kernel_block_sizes) == (
        kvcore.KVCacheLayout.LBHNC, [16])
    assert negotiation.config == kv.config and negotiation.groups == kv.negotiation.groups
    assert negotiation.layer_backends == dict.fromkeys(specs, COUNTED)
    text = negotiation.explain()
    for words in ("layout LBHNC: the first candidate that meets every kernel rule", "LBHNC: meets every rule",
                  "LBNHC: not tried", "counted for FullAttentionSpec: kernel block sizes 16; layouts LBHNC, LBNHC",
                  "strides below 2147483648 elements", "4 layers (layers.0.attn .. layers.3.attn): counted, named",
                  "kernel blocks of 16 tokens: the largest size every backend takes that divides 32"):
        assert words in text, (words, text)
