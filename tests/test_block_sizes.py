"""Block-size negotiation: selection, spec customization, per-group kernel sizes.

Invariant: the selected size divides the manager size and every backend
accepts it; it is the manager size when all accept that, else the largest
explicitly offered divisor all accept; when none exists, ValueError.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from _plugin_dists import clean_plugin_env  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcore
from kvcore.errors import PluginError
from kvcore.memory.layout import compute_layout_strides
from kvcore.specs import KVCacheSpec, MultipleOf


class SizeTable:
    """In-process plugin: kernel block sizes per backend class."""

    def __init__(self, table):
        self.table = table

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return self.table.get(backend)


def backend(name, **attrs):
    return type(f"B_{name}", (kvcore.AttentionBackend,), {"name": name, **attrs})


@pytest.fixture
def pm():
    return kvcore.get_plugin_manager(autoload=False)


def with_sizes(pm, *size_lists):
    backends = [backend(f"b{i}") for i in range(len(size_lists))]
    plugin = SizeTable(dict(zip(backends, size_lists)))
    pm.register(plugin)
    return backends


@pytest.mark.parametrize(
    "size_lists, manager, expected",
    [
        (([MultipleOf(32)], [64, MultipleOf(16)]), 128, 128),
        (([128, 64], [64, 32]), 256, 64),
        (([16, 64], [MultipleOf(16)]), 48, 16),
        ((), 48, 48),
    ],
)
def test_worked_examples(pm, size_lists, manager, expected):
    backends = with_sizes(pm, *size_lists)
    assert kvcore.select_common_block_size(manager, backends, plugin_manager=pm) == expected


def test_no_common_size_names_every_backend(pm):
    backends = with_sizes(pm, [64], [MultipleOf(16)])
    with pytest.raises(ValueError, match=r"^No common block size for 48 \(b0: \[64\]; b1: \[MultipleOf\(base=16\)\]\)"):
        kvcore.select_common_block_size(48, backends, plugin_manager=pm)


def test_only_explicit_sizes_are_candidates(pm):
    # b0's base 16 divides 64, but only b1's explicit sizes are tried: the largest wins.
    backends = with_sizes(pm, [MultipleOf(16)], [8, 32])
    assert kvcore.select_common_block_size(64, backends, plugin_manager=pm) == 32
    backends = with_sizes(pm, [MultipleOf(16)], [8, 24])
    with pytest.raises(ValueError, match="No common block size for 64"):
        kvcore.select_common_block_size(64, backends, plugin_manager=pm)


def test_sizes_come_from_the_hook_not_the_class(pm):
    decoy = backend("decoy", supported_kernel_block_sizes=[16], get_supported_kernel_block_sizes=lambda s: [16])
    assert kvcore.select_common_block_size(64, [decoy], plugin_manager=pm) == 64
    pm.register(SizeTable({decoy: [32]}))
    assert kvcore.select_common_block_size(64, [decoy], plugin_manager=pm) == 32


def test_bad_arguments(pm):
    (b0,) = with_sizes(pm, [16])
    with pytest.raises(ValueError, match="kv_manager_block_size must be a positive integer, got 0"):
        kvcore.select_common_block_size(0, [b0], plugin_manager=pm)
    with pytest.raises(ValueError, match="kv_cache_specs has 2 entries for 1 backends"):
        kvcore.select_common_block_size(64, [b0], [None, None], plugin_manager=pm)
    with pytest.raises(TypeError, match="AttentionBackend subclass or a registered backend name"):
        kvcore.select_common_block_size(64, [object], plugin_manager=pm)


SIZE = st.one_of(st.integers(1, 96), st.builds(MultipleOf, st.integers(1, 48)))


def _accepts(sizes, n):
    return any(n % s.base == 0 if isinstance(s, MultipleOf) else s == n for s in sizes)


@settings(max_examples=60, deadline=None)
@given(
    manager=st.integers(1, 192),
    size_lists=st.lists(st.lists(SIZE, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_selection_matches_the_definition(manager, size_lists):
    pm = kvcore.get_plugin_manager(autoload=False)
    backends = with_sizes(pm, *size_lists)
    if all(_accepts(s, manager) for s in size_lists):
        expected = manager
    else:
        offered = {s for ss in size_lists for s in ss if isinstance(s, int)}
        common = [d for d in range(1, manager + 1)
                  if manager % d == 0 and d in offered and all(_accepts(s, d) for s in size_lists)]
        expected = max(common) if common else None
    if expected is None:
        with pytest.raises(ValueError, match=f"No common block size for {manager} "):
            kvcore.select_common_block_size(manager, backends, plugin_manager=pm)
        return
    got = kvcore.select_common_block_size(manager, backends, plugin_manager=pm)
    assert got == expected
    assert manager % got == 0 and all(_accepts(s, got) for s in size_lists)


class Customizer:
    def __init__(self, target):
        self.target = target

    @kvcore.hookimpl
    def kvcore_customize_spec(self, backend, spec):
        if backend is self.target and isinstance(spec, kvcore.AttentionSpec):
            return attrs.evolve(spec, num_head_slots=8)
        return None


def test_customize_applies_hook_then_alignment(pm):
    fixed, flexible, untouched = with_sizes(pm, [16, 32], [32, MultipleOf(16)], [MultipleOf(8)])
    pm.register(Customizer(fixed))
    spec = kvcore.FullAttentionSpec(64, 2, 32, torch.float16)
    custom = kvcore.customize_attention_spec(fixed, spec, plugin_manager=pm)
    assert custom.num_head_slots == 8 and custom.block_stride_alignment == MultipleOf(32)
    assert kvcore.customize_attention_spec(flexible, spec, plugin_manager=pm) == spec
    assert kvcore.customize_attention_spec(untouched, spec, plugin_manager=pm) == spec
    aligned = kvcore.FullAttentionSpec(64, 2, 32, torch.float16, block_stride_alignment=MultipleOf(4))
    assert kvcore.customize_attention_spec(fixed, aligned, plugin_manager=pm).block_stride_alignment == MultipleOf(4)
    mamba = kvcore.MambaSpec(64, [(4, 8)], [torch.float32])
    assert kvcore.customize_attention_spec(fixed, mamba, plugin_manager=pm).block_stride_alignment is None


def test_customize_refuses_non_spec_answers(pm):
    (b0,) = with_sizes(pm, [16])

    class Bad:
        @kvcore.hookimpl
        def kvcore_customize_spec(self, backend, spec):
            return {"block_size": 16}

    pm.register(Bad(), name="bad-customizer")
    with pytest.raises(PluginError, match="bad-customizer.*expected a KVCacheSpec.*kvcore_customize_spec"):
        kvcore.customize_attention_spec(b0, kvcore.FullAttentionSpec(16, 1, 8, torch.float16), plugin_manager=pm)
    assert pm.hook.kvcore_supported_kernel_block_sizes(backend=b0, spec=None) == [16]


class RawSpec(KVCacheSpec):
    """A spec whose owner lays out a raw buffer itself."""

    @property
    def page_size_bytes(self):
        return 256

    @property
    def has_layer_views(self):
        return False


def _tensor(spec, layers, layout, num_blocks=4):
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    size = num_blocks * len(layers) * spec.page_size_bytes
    return kvcore.KVCacheTensor(size, layers, strides[0], strides[1])


def test_prepare_kernel_block_sizes_per_group(pm):
    fixed16, any_size = with_sizes(pm, [16], [MultipleOf(1)])
    full = kvcore.FullAttentionSpec(64, 2, 16, torch.float16)
    enc = kvcore.EncoderOnlyAttentionSpec(64, 2, 16, torch.float16)
    mamba = kvcore.MambaSpec(64, [(2, 256)], [torch.float16])
    raw = RawSpec(64)
    groups = [
        kvcore.KVCacheGroupSpec(["f0", "f1"], full),
        kvcore.KVCacheGroupSpec(["e0"], enc),
        kvcore.KVCacheGroupSpec(["m0"], mamba),
        kvcore.KVCacheGroupSpec(["r0"], raw),
        kvcore.KVCacheGroupSpec(["g0"], full),
    ]
    tensors = [_tensor(full, ["f0", "f1"], "LBNHC"), _tensor(full, ["g0"], "LBNHC")]
    config = kvcore.KVCacheConfig(4, tensors, groups, "LBNHC")
    attn_groups = [
        [kvcore.AttentionGroup(fixed16, ["f0"], full, 0), kvcore.AttentionGroup(any_size, ["f1"], full, 0)],
        [kvcore.AttentionGroup(any_size, ["e0"], enc, 1)],
        [],
        [],
        [kvcore.AttentionGroup(any_size, ["g0"], full, 4)],
    ]
    # encoder-only skipped; state cache and raw spec keep 64.
    assert kvcore.prepare_kernel_block_sizes(config, attn_groups, plugin_manager=pm) == [16, 64, 64, 64]


def test_prepare_keeps_manager_size_for_block_outermost_packed(pm):
    (fixed16,) = with_sizes(pm, [16])
    full = kvcore.FullAttentionSpec(64, 1, 16, torch.float16)
    group = kvcore.KVCacheGroupSpec(["a", "b"], full)
    groups = [[kvcore.AttentionGroup(fixed16, ["a", "b"], full, 0)]]
    packed = kvcore.KVCacheConfig(4, [_tensor(full, ["a", "b"], "BLNHC")], [group], "BLNHC")
    assert packed.kv_cache_tensors[0].block_stride > packed.kv_cache_tensors[0].layer_stride
    assert kvcore.prepare_kernel_block_sizes(packed, groups, plugin_manager=pm) == [64]
    dense = kvcore.KVCacheConfig(4, [_tensor(full, ["a", "b"], "LBNHC")], [group], "LBNHC")
    assert kvcore.prepare_kernel_block_sizes(dense, groups, plugin_manager=pm) == [16]
    with pytest.raises(ValueError, match="attn_groups has 0 entries but KV cache group 0"):
        kvcore.prepare_kernel_block_sizes(dense, [], plugin_manager=pm)


@pytest.mark.parametrize(
    "args, kwargs, width",
    [((1875, 64), {}, 1876), ((3, 64), {}, 4), ((5, 48), {}, 8), ((5, 48, 16), {}, 24),
     ((5, 48), {"token_alignment": None}, 5), ((1, 256, 64), {}, 4)],
)
def test_block_table_width_worked_examples(args, kwargs, width):
    assert kvcore.get_block_table_width(*args, **kwargs) == width


@settings(max_examples=80, deadline=None, derandomize=True)
@given(blocks=st.integers(1, 3000), block_size=st.sampled_from([1, 3, 16, 48, 64, 96, 128, 256]),
       align=st.sampled_from([None, 1, 64, 128, 100]))
def test_block_table_rows_cover_the_fewest_aligned_tokens(blocks, block_size, align):
    width = kvcore.get_block_table_width(blocks, block_size, token_alignment=align)
    assert width >= blocks
    if align is None:
        assert width == blocks
        return
    assert (width * block_size) % align == 0
    smaller = [w for w in range(blocks, width) if (w * block_size) % align == 0]
    assert not smaller  # the first width at or above `blocks` that aligns


def test_block_table_width_refuses_bad_sizes():
    with pytest.raises(ValueError, match="not divisible by kernel block size 5"):
        kvcore.get_block_table_width(4, 16, 5)
    with pytest.raises(ValueError, match="max_num_blocks must be a positive integer, got 0"):
        kvcore.get_block_table_width(0, 16)


@attrs.frozen
class TaggedSpec(kvcore.FullAttentionSpec):
    """A spec subclass with a list field, so its instances cannot be hashed."""

    tags: list = attrs.field(factory=list, kw_only=True)


def test_unhashable_spec_negotiates_like_a_hashable_one(pm):
    fixed, flexible = with_sizes(pm, [16, 32], [32, MultipleOf(16)])
    pm.register(Customizer(fixed))
    plain = kvcore.FullAttentionSpec(64, 2, 32, torch.float16)
    tagged = TaggedSpec(64, 2, 32, torch.float16, tags=["draft"])
    with pytest.raises(TypeError, match="unhashable"):
        hash(tagged)
    for manager in (64, 48):
        assert kvcore.select_common_block_size(
            manager, [fixed, flexible], [tagged, tagged], plugin_manager=pm
        ) == kvcore.select_common_block_size(
            manager, [fixed, flexible], [plain, plain], plugin_manager=pm
        )
    custom = kvcore.customize_attention_spec(fixed, tagged, plugin_manager=pm)
    assert custom.tags == ["draft"]
    assert custom.num_head_slots == 8 and custom.block_stride_alignment == MultipleOf(32)
    auto = kvcore.get_plugin_manager()
    assert kvcore.select_backend(tagged, "cpu", plugin_manager=auto) is kvcore.select_backend(
        plain, "cpu", plugin_manager=auto
    )


def test_an_unhashable_spec_is_refused_where_layers_are_grouped():
    specs = {f"layers.{i}.attn": TaggedSpec(16, 2, 32, torch.float32, tags=["d"]) for i in range(2)}
    with pytest.raises(TypeError, match=r"layers.0.attn.*TaggedSpec.*cannot be hashed.*attrs.frozen"):
        kvcore.plan_kv_cache(specs, "LBNHC", num_blocks=8)
    with pytest.raises(TypeError, match=r"layer_specs\['layers.0.attn'\].*tuples, not lists"):
        kvcore.KVCache.create(
            specs, dict.fromkeys(specs, "torch"), device="cpu", num_blocks=8, max_num_seqs=2,
            max_model_len=64,
        )
