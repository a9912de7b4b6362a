"""KVCache.create: the whole path from specs to kernel views, block pool and zeroer."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from kvcore import (
    AttentionBackend,
    CommonAttentionMetadata,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCache,
    KVCacheLayout,
    MambaSpec,
    MultipleOf,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_plugin_manager,
    hookimpl,
)
from kvcore_torch import TorchAttentionBackend

LAYERS = [f"layers.{i}.attn" for i in range(4)]


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    monkeypatch.delenv("KVCORE_KV_CACHE_LAYOUT", raising=False)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def specs(block_size: int = 16, hybrid: bool = False) -> dict[str, Any]:
    out = {}
    for i, name in enumerate(LAYERS):
        if hybrid and i % 2:
            out[name] = SlidingWindowSpec(block_size, 2, 8, torch.float32, sliding_window=32)
        else:
            out[name] = FullAttentionSpec(block_size, 2, 8, torch.float32)
    return out


def create(pm, backend: Any = "torch", **kwargs: Any) -> KVCache:
    layer_specs = kwargs.pop("layer_specs", None) or specs()
    kwargs.setdefault("num_blocks", 10)
    kwargs.setdefault("device", "cpu")
    return KVCache.create(
        layer_specs,
        {name: backend for name in layer_specs},
        max_num_seqs=4,
        max_model_len=256,
        plugin_manager=pm,
        **kwargs,
    )


def rows_of(kv: KVCache, layer: str, block_ids: list[int]) -> torch.Tensor:
    group = kv.group_of(layer)
    ratio = group.blocks_per_manager_block
    ids = torch.tensor(block_ids)[:, None] * (group.kernel_block_stride or ratio)
    return (ids + torch.arange(ratio)).flatten()


@pytest.mark.parametrize("hybrid", [False, True], ids=["uniform", "hybrid"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_create_every_layout_and_zero_new_blocks(pm, layout, hybrid):
    kv = create(pm, layout=layout, layer_specs=specs(hybrid=hybrid))
    assert kv.layout is layout and kv.config.layout is layout
    assert kv.block_pool.num_blocks == kv.num_blocks == 10
    assert kv.num_groups == (2 if hybrid else 1)
    assert kv.kernel_block_sizes == [16] * kv.num_groups
    for name in LAYERS:
        view = kv.layer_kv_caches[name]
        assert view.shape == (10, 2, 16, 16) and view.dtype == torch.float32
        # physical order of the layer view follows the layout (largest stride first)
        by_stride = sorted(range(4), key=lambda d: -view.stride(d))
        assert tuple(by_stride) == layout.layer_view_order
    gen = torch.Generator().manual_seed(0)
    for view in kv.layer_kv_caches.values():
        view.copy_(torch.randn(view.shape, generator=gen) + 3.0)
    before = {n: v.clone() for n, v in kv.layer_kv_caches.items()}
    new = kv.block_pool.allocate(3)
    # NOTE: on a CPU the cache zeroes with indexed fills (the interpreted kernel is far slower)
    assert kv.zeroer.backend == "torch"
    assert kv.begin_step() == new
    for name, view in kv.layer_kv_caches.items():
        mask = torch.zeros(view.shape[0], dtype=torch.bool)
        mask[rows_of(kv, name, new)] = True
        assert not view[mask].count_nonzero()
        # every other block of every layer is untouched (groups overlay, so a
        # block id zeroes that block in all groups' views)
        assert torch.equal(view[~mask], before[name][~mask])
    snapshot = {n: v.clone() for n, v in kv.layer_kv_caches.items()}
    assert kv.begin_step() == []
    assert all(torch.equal(v, snapshot[n]) for n, v in kv.layer_kv_caches.items())


def test_backend_by_class_and_available_memory(pm):
    page = specs()[LAYERS[0]].page_size_bytes
    kv = create(pm, TorchAttentionBackend, num_blocks=None, available_memory=7 * 4 * page + 5)
    assert kv.num_blocks == 7
    assert kv.layout is KVCacheLayout.LBNHC  # the backend's first preference
    assert kv.group_of(LAYERS[2]).backend is TorchAttentionBackend
    assert kv.block_size(0) == 16


def _triton_reference(q, k, v, scale):
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, dim=1)) * scale
    causal = torch.ones(len(q), len(k), dtype=torch.bool).tril(len(k) - len(q))
    return torch.einsum("hts,shd->thd", scores.masked_fill(~causal, -torch.inf).softmax(-1),
                        v.repeat_interleave(2, dim=1))


def test_triton_splits_128_token_blocks_into_64(pm):
    # NOTE: Triton needs CUDA tensors, or CPU tensors under the interpreter (conftest.py).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = create(pm, "triton", layer_specs=specs(block_size=128), num_blocks=6, device=device)
    assert kv.kernel_block_sizes == [64]
    spec = kv.config.kv_cache_groups[0].kv_cache_spec
    assert spec.block_stride_alignment == MultipleOf(64)
    name = LAYERS[1]
    assert kv.layer_kv_caches[name].shape == (12, 2, 64, 16)
    group = kv.group_of(name)
    table = torch.tensor([[3, 5]], dtype=torch.int32, device=device)
    assert group.map_to_kernel_block_table(table).tolist() == [[6, 7, 10, 11]]

    # one 70-token prefill in manager block 4 (kernel blocks 8, 9), through the interpreter
    blocks = kv.block_pool.allocate(4)
    assert kv.begin_step() == blocks
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(70, h, 8, generator=gen) for h in (4, 2, 2))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 70], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([70], dtype=torch.int32, device=device),
        block_table_tensor=torch.tensor([[blocks[-1]]], dtype=torch.int32, device=device),
        slot_mapping=blocks[-1] * 128 + torch.arange(70, device=device),
        num_reqs=1, num_actual_tokens=70, max_query_len=70, max_seq_len=70,
    )
    metadata = kv.build_metadata([common])
    assert metadata[name].block_table_tensor.tolist() == [[2 * blocks[-1], 2 * blocks[-1] + 1]]
    qkv = [t.to(device) for t in (q, k, v)]
    out = group.backend.forward(*qkv, kv.layer_kv_caches[name], metadata[name], head_size=8, scale=0.35)
    # fp32 dots run as tf32 on the GPU
    tol = 1e-4 if device == "cpu" else 3e-3
    torch.testing.assert_close(out.cpu(), _triton_reference(q, k, v, 0.35), atol=tol, rtol=tol)


def test_packed_layout_cannot_split_and_names_the_remedy(pm):
    with pytest.raises(ValueError, match="LBNHC"):
        create(pm, "triton", layer_specs=specs(block_size=128), layout="BLNHC",
               device="cuda" if torch.cuda.is_available() else "cpu")


class Fixed8Backend(AttentionBackend):
    name: ClassVar[str] = "fixed8"
    forward = TorchAttentionBackend.__dict__["forward"]


class Fixed8Plugin:
    @hookimpl
    def kvcore_register_backends(self, register):
        register(Fixed8Backend)

    @hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return [8] if backend is Fixed8Backend else None

    @hookimpl
    def kvcore_supported_layouts(self, backend, spec):
        return ["LBHNC", "BLHNC"] if backend is Fixed8Backend else None


def test_in_process_plugin_drives_layout_alignment_and_kernel_size():
    pm = get_plugin_manager(autoload=False)
    pm.register(Fixed8Plugin(), name="fixed8-plugin")
    kv = create(pm, "fixed8", layer_specs=specs(block_size=32), num_blocks=5)
    assert kv.layout is KVCacheLayout.LBHNC
    assert kv.kernel_block_sizes == [8]
    # specs were customized before planning: the plan carries the alignment
    assert kv.config.kv_cache_groups[0].kv_cache_spec.block_stride_alignment == MultipleOf(8)
    assert kv.layer_kv_caches[LAYERS[0]].shape == (20, 2, 8, 16)
    assert kv.kv_caches[LAYERS[0]].shape == (20, 2, 8, 16)
    with pytest.raises(ValueError, match="LBNHC"):
        create(pm, "fixed8", layout="LBNHC")


def test_bad_input_is_refused(pm):
    with pytest.raises(ValueError, match="Registered"):
        create(pm, "no-such-backend")
    with pytest.raises(ValueError, match="no backend"):
        KVCache.create(specs(), {LAYERS[0]: "torch"}, device="cpu", num_blocks=4,
                       max_num_seqs=1, max_model_len=16, plugin_manager=pm)
    with pytest.raises(ValueError, match="without a spec"):
        KVCache.create(specs(), {n: "torch" for n in [*LAYERS, "extra"]}, device="cpu",
                       num_blocks=4, max_num_seqs=1, max_model_len=16, plugin_manager=pm)
    with pytest.raises(ValueError):
        create(pm, num_blocks=4, available_memory=1 << 20)
    with pytest.raises(ValueError, match="max_num_seqs"):
        KVCache.create(specs(), {n: "torch" for n in LAYERS}, device="cpu", num_blocks=4,
                       max_num_seqs=0, max_model_len=16, plugin_manager=pm)
    grouped = UniformTypeKVCacheSpecs(16, {n: FullAttentionSpec(16, 2, 8, torch.float32) for n in LAYERS})
    for backends in ({}, {"grouped": "torch"}):
        with pytest.raises(TypeError, match="layer 'grouped' needs a per-layer KVCacheSpec"):
            KVCache.create({"grouped": grouped}, backends, device="cpu", num_blocks=4,
                           max_num_seqs=1, max_model_len=16, plugin_manager=pm)
    kv = create(pm)
    with pytest.raises(ValueError, match="one per group"):
        kv.build_metadata([])
    with pytest.raises(ValueError, match="no attention group"):
        kv.group_of("layers.9.attn")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_single_rank_group_agrees_with_itself(pm, tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    page = specs()[LAYERS[0]].page_size_bytes
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        kv = create(pm, num_blocks=None, available_memory=9 * 4 * page, layout="BLNHC",
                    group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert kv.num_blocks == 9 and kv.layout is KVCacheLayout.BLNHC


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
@pytest.mark.parametrize("with_attention", [True, False])
def test_state_cache_blocks_are_zeroed_too(pm, layout, with_attention):
    """Mamba layers have no attention backend, yet their new blocks are zeroed by begin_step."""
    mamba = MambaSpec(16, [(4, 8), (2, 16)], [torch.float32, torch.float32])
    layer_specs = {"layers.0.mamba": mamba, "layers.2.mamba": mamba}
    if with_attention:
        layer_specs["layers.1.attn"] = FullAttentionSpec(16, 2, 8, torch.float32)
    kv = KVCache.create(
        layer_specs, {n: "torch" for n in layer_specs if "attn" in n}, device="cpu", layout=layout,
        num_blocks=8, max_num_seqs=2, max_model_len=64, plugin_manager=pm,
    )
    gen = torch.Generator().manual_seed(3)
    for view in kv.kv_caches.values():
        view.view(torch.int8).copy_(torch.randint(1, 127, view.view(torch.int8).shape, generator=gen))
    before = {name: view.clone() for name, view in kv.kv_caches.items()}
    blocks = kv.block_pool.allocate(2)
    assert kv.begin_step() == blocks
    state = kv.kv_caches["layers.0.mamba"]
    assert state.shape[1:3] == (1, 1)
    for name, view in kv.kv_caches.items():
        assert torch.all(view[blocks] == 0), name
        others = [b for b in range(kv.num_blocks) if b not in blocks]
        assert torch.equal(view[others], before[name][others]), name


def test_encoder_only_layers_get_no_pages_but_do_not_break_create(pm):
    """Encoder-only groups are skipped by kernel block sizes and hold no tensor."""
    layer_specs = specs()
    layer_specs["encoder.0.attn"] = EncoderOnlyAttentionSpec(16, 2, 8, torch.float32)
    kv = KVCache.create(
        layer_specs, dict.fromkeys(layer_specs, "torch"), device="cpu",
        num_blocks=6, max_num_seqs=2, max_model_len=64, plugin_manager=pm,
    )
    assert "encoder.0.attn" not in kv.kv_caches
    assert len(kv.kernel_block_sizes) == kv.num_groups - 1
    for view in kv.kv_caches.values():
        view.fill_(3.0)
    blocks = kv.block_pool.allocate(2)
    assert kv.begin_step() == blocks
    for view in kv.kv_caches.values():
        assert torch.all(view[blocks] == 0) and torch.all(view[[b for b in range(6) if b not in blocks]] == 3.0)


def test_create_names_a_missing_cuda_device_and_an_oversized_cache(pm, monkeypatch):
    from kvcore.errors import KVCoreError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVCoreError, match="device 'cuda' was requested but this torch has no usable CUDA"):
        create(pm, device="cuda")
    with pytest.raises(KVCoreError, match=r"cannot allocate the \d[\d,.]* TiB KV cache on cpu.*less memory"):
        create(pm, num_blocks=None, available_memory=1 << 52)


@pytest.mark.parametrize("caching", [False, True])
def test_begin_step_is_all_or_nothing_when_zeroing_fails(pm, caching):
    """A failed zeroing leaves the blocks pending: the next step zeroes them."""
    kv = create(pm)
    if caching:
        kv.block_pool = type(kv.block_pool)(kv.num_blocks, enable_caching=True)
    for view in kv.kv_caches.values():
        view.copy_(torch.randn_like(view).abs() + 1)
    blocks = kv.block_pool.allocate(3)
    real_zero = kv.zeroer.zero_block_ids
    calls = []

    def failing(ids):
        calls.append(list(ids))
        raise KeyboardInterrupt

    kv.zeroer.zero_block_ids = failing
    with pytest.raises(KeyboardInterrupt):
        kv.begin_step()
    assert all(kv.layer_kv_caches[n][rows_of(kv, n, blocks)].abs().min() > 0 for n in LAYERS)
    kv.zeroer.zero_block_ids = real_zero
    kv.block_pool.free(blocks[:1])  # freed before it was zeroed: left out, zeroed when reused
    assert sorted(kv.begin_step()) == sorted(blocks[1:])
    assert calls == [blocks]
    for name in LAYERS:
        assert torch.count_nonzero(kv.layer_kv_caches[name][rows_of(kv, name, blocks[1:])]) == 0
    assert kv.begin_step() == []
