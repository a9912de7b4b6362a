"""allocate_kv_cache and the config classes it reads."""

from __future__ import annotations

import pytest
import torch

from kvcore.errors import KVCoreError
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


class RawPageSpec(KVCacheSpec):
    """A cache that lays out its own raw buffer (no per-layer views)."""

    @property
    def page_size_bytes(self) -> int:
        return 64

    @property
    def has_layer_views(self) -> bool:
        return False


def tensor_for(spec, num_blocks, layers, layout, size=None):
    s = compute_layout_strides(spec, num_blocks, len(layers), layout)
    size = size or num_blocks * len(layers) * spec.page_size_bytes
    return KVCacheTensor(size, layers, layer_stride=s[0], block_stride=s[1])


def two_group_config(layout="LBNHC"):
    """A full-attention group and a sliding-window group overlaid in one buffer."""
    full = FullAttentionSpec(16, 2, 8, torch.float16)  # page 2*16*32 = 1024
    swa = SlidingWindowSpec(16, 4, 4, torch.float32, sliding_window=64)  # page 4*16*32 = 2048
    num_blocks = 6
    size = 2 * num_blocks * 2048
    t_full = tensor_for(full, num_blocks, ["full.0", "full.1"], layout, size)
    t_swa = tensor_for(swa, num_blocks, ["swa.0", "swa.1"], layout, size)
    groups = [KVCacheGroupSpec(["full.0", "full.1"], full), KVCacheGroupSpec(["swa.0", "swa.1"], swa)]
    return KVCacheConfig(num_blocks, [t_full, t_swa], groups, layout), full, swa


def test_one_zero_filled_allocation_shared_by_all_views():
    config, full, swa = two_group_config()
    caches = allocate_kv_cache(config, "cpu")
    assert list(caches) == ["full.0", "full.1", "swa.0", "swa.1"]
    ptrs = {v.untyped_storage().data_ptr() for v in caches.values()}
    assert len(ptrs) == 1
    assert {v.untyped_storage().nbytes() for v in caches.values()} == {2 * 6 * 2048}
    for view in caches.values():
        assert not view.any()
    assert caches["full.0"].dtype is torch.float16 and caches["full.0"].shape == (6, 2, 16, 16)
    assert caches["swa.1"].dtype is torch.float32 and caches["swa.1"].shape == (6, 4, 16, 8)


def test_groups_overlay_from_byte_zero():
    config, full, swa = two_group_config()
    caches = allocate_kv_cache(config, "cpu")
    assert caches["full.0"].storage_offset() == 0 and caches["swa.0"].storage_offset() == 0
    # Block 0 of both groups' first layer is the same memory (LBNHC pages are [N, H, C]).
    raw = torch.empty(0, dtype=torch.int8).set_(caches["swa.0"].untyped_storage())
    caches["swa.0"][0].copy_(torch.randn(4, 16, 8))
    swa_bytes = caches["swa.0"][0].transpose(0, 1).reshape(-1).view(torch.int8)
    full_bytes = caches["full.0"][0].transpose(0, 1).reshape(-1).view(torch.int8)
    assert torch.equal(swa_bytes, raw[:2048]) and swa_bytes.any()
    assert torch.equal(full_bytes, raw[:1024])


def test_k_is_the_head_size_prefix():
    spec = FullAttentionSpec(8, 2, 4, torch.bfloat16, head_size_v=6)
    config = KVCacheConfig(3, [tensor_for(spec, 3, ["a"], "LBHNC")], [KVCacheGroupSpec(["a"], spec)], "LBHNC")
    view = allocate_kv_cache(config, "cpu")["a"]
    assert view.shape == (3, 2, 8, 10) and view.dtype is torch.bfloat16
    k, v = view[..., :4], view[..., 4:]
    k.copy_(torch.randn(k.shape))
    v.copy_(torch.randn(v.shape))
    raw = view.reshape(-1)  # contiguous in LBHNC
    # state (block 1, head 0, token 2): bytes of K then V
    at = ((1 * 2 + 0) * 8 + 2) * 10
    assert torch.equal(raw[at : at + 4], k[1, 0, 2]) and torch.equal(raw[at + 4 : at + 10], v[1, 0, 2])


def test_raw_buffer_for_specs_without_layer_views():
    spec = RawPageSpec(16)
    attn = FullAttentionSpec(16, 1, 16, torch.float16)  # page 16*64 = 1024
    size = 4 * 1024
    tensors = [
        tensor_for(attn, 4, ["attn"], "LBNHC", size),
        KVCacheTensor(size, ["raw.0", "raw.1"], layer_stride=256, block_stride=64),
    ]
    groups = [KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["raw.0", "raw.1"], spec)]
    caches = allocate_kv_cache(KVCacheConfig(4, tensors, groups, "LBNHC"), "cpu")
    assert caches["raw.0"] is caches["raw.1"]
    buf = caches["raw.0"]
    assert buf.dtype is torch.int8 and buf.shape == (size,) and not buf.any()
    assert buf.untyped_storage().data_ptr() == caches["attn"].untyped_storage().data_ptr()


def test_state_cache_and_uniform_type_groups():
    mamba = MambaSpec(16, [(2, 4)], [torch.float32])  # page 32 bytes
    a = FullAttentionSpec(16, 2, 4, torch.float16)  # page 512
    b = FullAttentionSpec(16, 1, 8, torch.float16)  # page 512
    uniform = UniformTypeKVCacheSpecs(16, {"a": a, "b": b})
    size = 4 * 1024
    tensors = [
        tensor_for(a, 4, ["a"], "LBNHC", size),
        KVCacheTensor(size, ["b"], layer_stride=0, block_stride=512, offset=2048),
        tensor_for(mamba, 4, ["m"], "LBNHC", size),
    ]
    groups = [KVCacheGroupSpec(["a", "b"], uniform), KVCacheGroupSpec(["m"], mamba)]
    caches = allocate_kv_cache(KVCacheConfig(4, tensors, groups, "BLNHC"), "cpu", layout="BLNHC")
    assert caches["a"].shape == (4, 2, 16, 8)
    assert caches["b"].shape == (4, 1, 16, 16) and caches["b"].storage_offset() * 2 == 2048
    assert caches["m"].shape == (4, 1, 1, 8) and caches["m"].dtype is torch.float32
    (state,) = mamba.split_states(caches["m"])
    assert state.shape == (4, 2, 4)


def test_kernel_block_sizes_per_group():
    config, full, swa = two_group_config()
    caches = allocate_kv_cache(config, "cpu", kernel_block_sizes=[4, 16])
    assert caches["full.1"].shape == (24, 2, 4, 16)
    assert caches["swa.1"].shape == (6, 4, 16, 8)
    # Kernel block 4*b + j of layer 1 is the j-th quarter of manager block b's page.
    manager = allocate_kv_cache(config, "cpu")["full.1"]
    # fp16 elements: C=16, H=16 (32 bytes), N=2*16, kernel block=4*32
    assert caches["full.1"].stride() == (128, 16, 32, 1)
    assert manager.stride()[0] == 4 * caches["full.1"].stride()[0]
    assert caches["full.1"][4 * 2 + 3].storage_offset() == manager[2].storage_offset() + 3 * 128
    # A shorter list leaves later groups unsplit.
    assert allocate_kv_cache(config, "cpu", kernel_block_sizes=[8])["swa.0"].shape == (6, 4, 16, 8)


def test_packed_layout_refuses_group_split():
    config, _, _ = two_group_config("BLNHC")
    with pytest.raises(ValueError, match="BLNHC does not store.*smaller manager block size.*LBNHC"):
        allocate_kv_cache(config, "cpu", kernel_block_sizes=[4, 16])


@pytest.mark.parametrize("planned", list(KVCacheLayout), ids=lambda x: x.name)
def test_a_layout_other_than_the_plans_is_refused(planned):
    specs = {f"l{i}": FullAttentionSpec(16, 2, 8, torch.float16) for i in range(2)}
    config = plan_kv_cache(specs, planned, num_blocks=4)
    views = allocate_kv_cache(config, "cpu")  # None: the plan's layout
    assert views == {} or all(v.shape[0] == 4 for v in views.values())
    assert allocate_kv_cache(config, "cpu", planned.name.lower())["l1"].stride() == views["l1"].stride()
    for other in KVCacheLayout:
        if other is planned:
            continue
        with pytest.raises(ValueError, match=f"layout {other.name} is not the layout the config was planned for "
                                             f"\\({planned.name}\\)"):
            allocate_kv_cache(config, "cpu", other)


def test_device_without_cuda_and_oversized_allocations_are_kvcore_errors(monkeypatch):
    specs = {"l0": FullAttentionSpec(16, 2, 8, torch.float16)}
    config = plan_kv_cache(specs, "LBNHC", num_blocks=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    match = "device 'cuda' was requested but this torch has no usable CUDA.*device='cpu'"
    with pytest.raises(KVCoreError, match=match):
        allocate_kv_cache(config, "cuda")
    with pytest.raises(KVCoreError, match="invalid device 'gpu0'"):
        allocate_kv_cache(config, "gpu0")
    huge = plan_kv_cache(specs, "LBNHC", available_memory=1 << 52)
    with pytest.raises(KVCoreError, match=r"cannot allocate the 4,096 TiB KV cache on cpu") as exc:
        allocate_kv_cache(huge, "cpu")
    assert "less memory" in str(exc.value) and isinstance(exc.value, ValueError)


def test_no_tensors():
    spec = FullAttentionSpec(16, 1, 8, torch.float16)
    assert allocate_kv_cache(KVCacheConfig(4, [], [KVCacheGroupSpec(["a"], spec)]), "cpu") == {}


def test_bad_allocate_input():
    config, full, swa = two_group_config()
    other = KVCacheTensor(config.kv_cache_tensors[0].size + 2, ["swa.0"], layer_stride=0, block_stride=8)
    bad_sizes = KVCacheConfig(6, [config.kv_cache_tensors[0], other], config.kv_cache_groups)
    with pytest.raises(ValueError, match=r"sizes differ: \[24576, 24578\]"):
        allocate_kv_cache(bad_sizes, "cpu")
    with pytest.raises(ValueError, match="'nope'"):
        allocate_kv_cache(config, "cpu", layout="nope")
    with pytest.raises(ValueError, match="kernel block size 5"):
        allocate_kv_cache(config, "cpu", kernel_block_sizes=[5])
    with pytest.raises(ValueError, match=r"kernel_block_sizes\[1\].*0"):
        allocate_kv_cache(config, "cpu", kernel_block_sizes=[16, 0])
    with pytest.raises(TypeError, match="kernel_block_sizes.*16"):
        allocate_kv_cache(config, "cpu", kernel_block_sizes=16)
    with pytest.raises(TypeError, match="KVCacheConfig.*'cfg'"):
        allocate_kv_cache("cfg", "cpu")
    orphan = KVCacheConfig(6, config.kv_cache_tensors, config.kv_cache_groups[:1])
    with pytest.raises(ValueError, match="'swa.0' is in no KV cache group"):
        allocate_kv_cache(orphan, "cpu")


def test_config_classes():
    spec = FullAttentionSpec(16, 1, 8, torch.float16)
    t = KVCacheTensor(1024, ["a", "b"], 512, 64)
    assert t.layers == ("a", "b") and t.offset == 0
    group = KVCacheGroupSpec(("a", "b"), spec)
    assert group.layer_names == ["a", "b"] and group.spec_of("b") is spec
    config = KVCacheConfig(8, [t], [group], "nhd")
    assert config.layout.name == "LBNHC"
    assert config.num_blocks_of(t) == 8
    assert config.group_of("b") == (0, group)
    assert config.layer_names == ["a", "b"]
    with pytest.raises(ValueError, match="not one of this config's tensors"):
        config.num_blocks_of(KVCacheTensor(1024, ["c"], 512, 64))


@pytest.mark.parametrize(
    "make, exc, text",
    [
        (lambda s: KVCacheTensor(0, ["a"], 0, 64), ValueError, "size.*0"),
        (lambda s: KVCacheTensor(64, ["a"], -1, 64), ValueError, "layer_stride.*-1"),
        (lambda s: KVCacheTensor(64, ["a"], 0, 0), ValueError, "block_stride.*0"),
        (lambda s: KVCacheTensor(64, ["a"], 0, 64, offset=-8), ValueError, "offset.*-8"),
        (lambda s: KVCacheTensor(64.0, ["a"], 0, 64), TypeError, "size.*64.0"),
        (lambda s: KVCacheTensor(64, "ab", 0, 64), TypeError, "'ab'"),
        (lambda s: KVCacheTensor(64, [], 0, 64), ValueError, "at least one layer"),
        (lambda s: KVCacheTensor(64, ["a", "a"], 0, 64), ValueError, r"repeats a layer: \['a', 'a'\]"),
        (lambda s: KVCacheTensor(64, ["a", 3], 0, 64), TypeError, "got 3"),
        (lambda s: KVCacheGroupSpec("layer0", s), TypeError, "'layer0'"),
        (lambda s: KVCacheGroupSpec(["a"], "spec"), TypeError, "KVCacheSpec.*'spec'"),
        (lambda s: KVCacheConfig(0, [], []), ValueError, "num_blocks.*0"),
        (lambda s: KVCacheConfig(4, ["t"], []), TypeError, "KVCacheTensor.*'t'"),
        (lambda s: KVCacheConfig(4, [], ["g"]), TypeError, "KVCacheGroupSpec.*'g'"),
        (lambda s: KVCacheConfig(4, [], [], "XYZ"), ValueError, "'XYZ'"),
    ],
)
def test_bad_config_input(make, exc, text):
    with pytest.raises(exc, match=text):
        make(FullAttentionSpec(16, 1, 8, torch.float16))
