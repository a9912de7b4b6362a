"""Attention groups: building them from a config, kernel block tables and kernel views.

Invariant: kernel block j of manager block b addresses exactly the bytes of
the j-th kernel-sized slice of manager block b, in every layer.
"""

from __future__ import annotations

import pytest
import torch
from _plugin_dists import clean_plugin_env, make_backend  # noqa: F401

import kvcore
from kvcore import build_attention_groups, map_kv_caches_to_kernel_blocks
from kvcore.memory.layout import compute_layout_strides
from kvcore.specs import KVCacheSpec, MultipleOf


class SizeTable:
    def __init__(self, table):
        self.table = table

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return self.table.get(backend)

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        for backend in self.table:
            register(backend)


FIXED16 = make_backend("fixed16")
ANY = make_backend("any-size")


@pytest.fixture
def pm():
    pm = kvcore.get_plugin_manager(autoload=False)
    plugin = SizeTable({FIXED16: [16], ANY: [MultipleOf(1)]})
    pm.register(plugin)
    yield pm
    pm.unregister(plugin)


def _config(spec, layers, layout, num_blocks):
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    size = num_blocks * len(layers) * spec.page_size_bytes
    tensor = kvcore.KVCacheTensor(size, layers, strides[0], strides[1])
    return kvcore.KVCacheConfig(num_blocks, [tensor], [kvcore.KVCacheGroupSpec(layers, spec)], layout)


class RawSpec(KVCacheSpec):
    @property
    def page_size_bytes(self):
        return 64

    @property
    def has_layer_views(self):
        return False


def test_groups_per_backend_and_spec_in_layer_order(pm):
    full = kvcore.FullAttentionSpec(64, 2, 16, torch.float16)
    mamba = kvcore.MambaSpec(64, [(4, 8)], [torch.float32])
    config = kvcore.KVCacheConfig(
        4, [], [kvcore.KVCacheGroupSpec(["a0", "a1", "a2"], full),
                kvcore.KVCacheGroupSpec(["r0"], RawSpec(64)),
                kvcore.KVCacheGroupSpec(["m0"], mamba)], "LBNHC",
    )
    groups = build_attention_groups(
        config, {"a0": FIXED16, "a1": "any-size", "a2": FIXED16, "r0": ANY}, plugin_manager=pm
    )
    assert [len(g) for g in groups] == [2, 0, 0]
    first, second = groups[0]
    assert (first.backend, first.layer_names, first.kv_cache_group_id) == (FIXED16, ["a0", "a2"], 0)
    assert first.kv_cache_spec.block_stride_alignment == MultipleOf(16)
    assert (second.backend, second.layer_names, second.kv_cache_spec) == (ANY, ["a1"], full)
    with pytest.raises(ValueError, match="attention layer 'a1' .* has no backend"):
        build_attention_groups(config, {"a0": FIXED16, "a2": ANY}, plugin_manager=pm)
    with pytest.raises(ValueError, match="Unknown attention backend 'nope'"):
        build_attention_groups(config, {"a0": "nope"}, plugin_manager=pm)


def test_dense_group_split_four_ways(pm):
    spec = kvcore.FullAttentionSpec(64, 2, 8, torch.float16)
    config = _config(spec, ["l0", "l1"], "LBNHC", num_blocks=6)
    groups = build_attention_groups(config, {"l0": FIXED16, "l1": FIXED16}, plugin_manager=pm)
    sizes = kvcore.prepare_kernel_block_sizes(config, groups, plugin_manager=pm)
    assert sizes == [16]
    (group,) = groups[0]
    group.create_metadata_builders("cpu", max_num_seqs=2, max_model_len=256,
                                   kernel_block_size=sizes[0], plugin_manager=pm)
    table = group.map_to_kernel_block_table(torch.tensor([[0, 2], [5, 1]], dtype=torch.int32))
    assert table.tolist() == [[0, 1, 2, 3, 8, 9, 10, 11], [20, 21, 22, 23, 4, 5, 6, 7]]
    manager = kvcore.allocate_kv_cache(config, "cpu")
    kernel = kvcore.allocate_kv_cache(config, "cpu", kernel_block_sizes=sizes)
    assert kernel["l0"].shape == (24, 2, 16, 16) and manager["l0"].shape == (6, 2, 64, 16)
    assert map_kv_caches_to_kernel_blocks(kernel, groups)["l1"] is kernel["l1"]


def test_packed_group_uses_its_kernel_block_stride(pm):
    # Compressed MLA-like cache: 4 tokens per state, one head, all layers of a block side by side.
    spec = kvcore.MLAAttentionSpec(64, 1, 16, torch.bfloat16, tokens_per_state=4)
    layers = ["m0", "m1", "m2"]
    config = _config(spec, layers, "BLNHC", num_blocks=5)
    groups = build_attention_groups(config, dict.fromkeys(layers, FIXED16), plugin_manager=pm)
    sizes = kvcore.prepare_kernel_block_sizes(config, groups, plugin_manager=pm)
    assert sizes == [64]  # packed: the group keeps manager blocks
    kv_caches = kvcore.allocate_kv_cache(config, "cpu", kernel_block_sizes=sizes)
    torch.manual_seed(0)
    for view in kv_caches.values():
        view.copy_(torch.randn(view.shape).to(view.dtype))
    (group,) = groups[0]
    group.create_metadata_builders("cpu", max_num_seqs=2, max_model_len=256,
                                   kernel_block_size=sizes[0], plugin_manager=pm)
    assert group.kernel_block_size == 16
    kernel_views = map_kv_caches_to_kernel_blocks(kv_caches, groups)
    assert kv_caches["m0"].shape == (5, 1, 16, 16)  # manager views are kept for connectors
    stride = group.kernel_block_stride
    assert stride == len(layers) * 4  # kernel pages between two blocks of one layer
    block_table = torch.tensor([[0, 2], [4, 3]], dtype=torch.int32)
    table = group.map_to_kernel_block_table(block_table)
    assert table[0].tolist() == [0, 1, 2, 3, 2 * stride, 2 * stride + 1, 2 * stride + 2, 2 * stride + 3]
    for name in layers:
        manager, kernel = kv_caches[name], kernel_views[name]
        for row, kernel_row in zip(block_table.tolist(), table.tolist()):
            # The kernel blocks of a row, concatenated, are that row's manager blocks.
            from_kernel = torch.cat([kernel[k] for k in kernel_row], dim=-2)
            from_manager = torch.cat([manager[b] for b in row], dim=-2)
            assert torch.equal(from_kernel, from_manager)
            for k in kernel_row:
                b, j = row[kernel_row.index(k) // 4], kernel_row.index(k) % 4
                assert kernel[k].data_ptr() == manager[b, :, 4 * j].data_ptr()
    back = group.map_kv_cache_to_manager_blocks(kernel_views["m1"], config.num_blocks)
    assert torch.equal(back, kv_caches["m1"])


def test_map_accepts_flat_and_nested_groups_and_keeps_input(pm):
    spec = kvcore.MLAAttentionSpec(64, 1, 16, torch.bfloat16, tokens_per_state=4)
    config = _config(spec, ["x", "y"], "BLNHC", num_blocks=3)
    groups = build_attention_groups(config, {"x": FIXED16, "y": FIXED16}, plugin_manager=pm)
    kv_caches = kvcore.allocate_kv_cache(config, "cpu")
    untouched = map_kv_caches_to_kernel_blocks(kv_caches, groups)
    assert all(untouched[n] is kv_caches[n] for n in kv_caches)
    groups[0][0].create_metadata_builders("cpu", max_num_seqs=1, max_model_len=64,
                                          kernel_block_size=64, plugin_manager=pm)
    nested = map_kv_caches_to_kernel_blocks(kv_caches, groups)
    flat = map_kv_caches_to_kernel_blocks(kv_caches, groups[0])
    assert nested["x"].shape == flat["x"].shape == (((3 - 1) * 8 + 4), 1, 4, 16)
    assert kv_caches["x"].shape == (3, 1, 16, 16)
    with pytest.raises(TypeError, match="AttentionGroup"):
        map_kv_caches_to_kernel_blocks(kv_caches, [3])


class _WidthBuilder(kvcore.AttentionMetadataBuilder):
    requires_block_table_width = True


WIDE = make_backend("wide", get_builder_cls=classmethod(lambda cls: _WidthBuilder))


@pytest.mark.parametrize("spec, kernel, width", [
    (kvcore.FullAttentionSpec(64, 2, 8, torch.float16), 16, 16 * 4),    # 1000 tokens: 16 blocks, x4 kernel blocks
    (kvcore.FullAttentionSpec(48, 2, 8, torch.float16), None, 24),      # 21 blocks, rows of 384 tokens -> 24
    (kvcore.MambaSpec(64, [(4, 8)], [torch.float32]), None, 1),          # state slots: no token rounding
])
def test_builders_and_kernel_tables_use_the_vllm_row_width(spec, kernel, width):
    pm = kvcore.get_plugin_manager(autoload=False)
    plugin = SizeTable({WIDE: [16] if kernel else [MultipleOf(1)]})
    pm.register(plugin)
    group = kvcore.AttentionGroup(WIDE, ["x"], spec, 0)
    group.create_metadata_builders("cpu", max_num_seqs=3, max_model_len=1000, kernel_block_size=kernel,
                                   plugin_manager=pm)
    assert group.get_metadata_builder().block_table_width == width
    if kernel:
        assert group.kernel_block_table.shape == (1, 3, width)


def test_packed_compressed_group_gets_kernel_block_table():
    """vLLM's own case: a packed compressed cache whose kernel needs 64-state pages, mapped from a
    manager view whose block stride holds more rows (5 x 64) than the group uses (4 x 64) and whose
    element type is not the spec's: the kernel view and the table follow the view's own stride."""
    fake = make_backend("packed-fake")
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(SizeTable({fake: [128, 256]}))
    spec = kvcore.MLAAttentionSpec(1024, 1, 128, torch.uint8, state_content_bytes=132, tokens_per_state=4)
    group = kvcore.AttentionGroup(fake, ["layer.0"], spec, 0)
    group.create_metadata_builders("cpu", max_num_seqs=4, max_model_len=8192, kernel_block_size=1024,
                                   plugin_manager=pm)
    assert group.get_metadata_builder().kv_cache_spec.block_size == 256
    row, stride_rows = 132, 5 * 64
    backing = torch.randperm(3 * stride_rows).repeat_interleave(row)  # NOTE: int64 rows, not the spec's bytes
    manager = backing.view(3, 1, stride_rows, row)[:, :, :256]
    pages = map_kv_caches_to_kernel_blocks({"layer.0": manager}, [group])["layer.0"]
    assert group.kernel_block_stride == 5
    common = kvcore.CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([2048], dtype=torch.int32),
        block_table_tensor=torch.tensor([[0, 2]], dtype=torch.int32), slot_mapping=torch.tensor([2047]),
        num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=2048,
    )
    table = group.build_metadata(common).block_table_tensor
    assert table.tolist() == [[0, 1, 2, 3, 10, 11, 12, 13]]
    assert torch.equal(pages[table[0, 4:], 0].flatten(0, 1), manager[2, 0])
    assert torch.equal(pages[table[0, :4], 0].flatten(0, 1), manager[0, 0])
