"""A quantized KVCache end to end on the torch backend: zeroing, writing, reading, scales from the
model, the per-layer metadata a backend receives, refusals, prefix-cache hits and elastic resize."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from _quant_caches import (
    MODES,
    PER_TOKEN_HEAD,
    block_byte_mask,
    block_rows,
    layer_specs,
    make_quant_cache,
    raw,
    torch_only,
)

import kvcore
from kvcore import KVCache, KVCacheLayout, get_plugin_manager, hookimpl
from kvcore.errors import KernelRequirementError
from kvcore.plugins.backend import AttentionMetadataBuilder, CommonAttentionMetadata, KVQuantState
from kvcore.plugins.requirements import KernelRequirements
from kvcore_torch import TorchAttentionBackend
from kvcore_torch.quant import dequantize, max_value

LAYOUTS = [layout.name for layout in KVCacheLayout]


def _step(kv: KVCache, seq_lens, new_lens, block_table):
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    slots = []
    for row, (seq, new) in enumerate(zip(seq_lens, new_lens)):
        slots += [block_table[row][p // 16] * 16 + p % 16 for p in range(seq - new, seq)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        num_reqs=len(seq_lens), num_actual_tokens=starts[-1], max_query_len=max(new_lens), max_seq_len=max(seq_lens),
    )
    return kv.build_metadata([common])


def _attend_all(kv, keys, values, queries, block_table):
    """Write ``keys``/``values`` ([tokens, 2, 16]) of one request through each layer's backend and
    attend with ``queries`` ([tokens, 4, 16]); the last layer's output."""
    n = keys.shape[0]
    metadata = _step(kv, [n], [n], [block_table])
    out = None
    for name in kv.kv_caches:
        group = kv.group_of(name)
        out = group.backend.forward(queries, keys, values, kv.layer_kv_caches[name], metadata[name],
                                    head_size=16, scale=0.25)
    return out


def _exact(keys, values, queries):
    k, v = keys.double().repeat_interleave(2, 1), values.double().repeat_interleave(2, 1)
    n = keys.shape[0]
    scores = torch.einsum("qhd,khd->hqk", queries.double(), k) * 0.25
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_new_blocks_read_as_zero_over_stale_nan_bytes(mode, layout):
    kv = make_quant_cache(mode, layout)
    memory = raw(kv)
    memory.fill_(-1)  # NOTE: 0xFF: NaN in both float8 formats and in float32 scales, -1 in int8
    ids = kv.block_pool.allocate(3)
    assert kv.begin_step() == ids
    mask = block_byte_mask(kv, ids)
    assert (memory[mask] == 0).all() and (memory[~mask] == -1).all()
    for name, view in kv.kv_caches.items():
        rows = block_rows(kv, view, ids).float()
        scales = block_rows(kv, kv.scale_caches[name], ids) if name in kv.scale_caches else kv.kv_scales[name][0]
        read = dequantize(rows[..., :16], scales[..., 0] if isinstance(scales, torch.Tensor) else scales)
        assert torch.equal(read, torch.zeros_like(read))


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("mode", MODES)
def test_backend_writes_and_reads_through_the_layers_metadata(mode, layout):
    kv = make_quant_cache(mode, layout)
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(2, 16, generator=gen)
    keys, values = (mean + torch.randn(20, 2, 16, generator=gen) for _ in range(2))
    queries = torch.randn(20, 4, 16, generator=gen)
    ids = kv.block_pool.allocate(2)
    kv.begin_step()
    out = _attend_all(kv, keys, values, queries, ids)
    exact = _exact(keys, values, queries)
    error = ((out.double() - exact).norm() / exact.norm()).item()
    # NOTE: early rows attend to one or two tokens, so errors do not average out: 2 mantissa
    # bits (e5m2) give about twice the error of 3 (e4m3); int8 rows keep 7 bits.
    assert error < {"int8_per_token_head": 1e-2, "fp8_e5m2": 8e-2}.get(mode, 4e-2), error
    assert out.isfinite().all()
    for name in kv.scale_caches:  # K and V scales of every written token: amax / max
        scales = block_rows(kv, kv.scale_caches[name], ids).permute(0, 2, 1, 3).reshape(-1, 2, 2)[:20]
        want = keys.abs().amax(-1) / max_value(MODES[mode][0])
        torch.testing.assert_close(scales[..., 0], want)


@pytest.mark.parametrize("mode", MODES)
def test_writes_saturate_and_zero_rows_keep_scale_zero(mode):
    kv = make_quant_cache(mode, "LBNHC")
    name = next(iter(kv.kv_caches))
    big = torch.full((3, 2, 16), 1e30)
    big[1] = -1e30
    big[2] = 0.0
    big[0, 0, 3] = 5.0
    ids = kv.block_pool.allocate(1)
    kv.begin_step()
    metadata = _step(kv, [3], [3], [ids])
    TorchAttentionBackend.forward(torch.zeros(3, 4, 16), big, big, kv.layer_kv_caches[name], metadata[name],
                                  head_size=16, scale=0.25)
    stored = block_rows(kv, kv.kv_caches[name], ids)[0, :, :3].float()  # [H, 3 tokens, C]
    limit = max_value(MODES[mode][0])
    assert stored.isfinite().all()
    if name in kv.scale_caches:  # per token and head: the largest value maps to the limit
        assert (stored[:, 0].abs().amax(-1) == limit).all() and (stored[:, 2] == 0).all()
        scales = block_rows(kv, kv.scale_caches[name], ids)[0, :, :3]
        assert (scales[:, 2] == 0).all() and scales[:, :2].isfinite().all()
    else:  # per tensor (scale 1): saturated, never inf or NaN
        assert torch.equal(stored[:, :, :16], big.clamp(-limit, limit).transpose(0, 1))


def test_scales_come_from_the_attention_modules_and_reach_the_metadata():
    kv = make_quant_cache("fp8", "LBNHC")
    names = list(kv.kv_caches)
    assert kv.kv_scales == dict.fromkeys(names, (1.0, 1.0)) and kv.scale_caches == {}

    class Attention(torch.nn.Module):
        def __init__(self, k, v):
            super().__init__()
            self.k_scale, self.v_scale = k, v

    kv.load_kv_scales({names[0]: Attention(0.5, torch.tensor(2.0)), names[1]: torch.nn.Identity()})
    assert kv.kv_scales[names[0]] == (0.5, 2.0) and kv.kv_scales[names[1]] == (1.0, 1.0)
    metadata = _step(kv, [1], [1], [[1]])
    state = metadata[names[0]].kv_quant
    assert isinstance(state, KVQuantState) and (state.k_scale, state.v_scale) == (0.5, 2.0)
    assert state.kv_quant == "per_tensor" and state.dtype == torch.float8_e4m3fn and state.scale_cache is None
    for bad in (0.0, float("nan"), -1.0, math.inf):
        with pytest.raises(ValueError, match="k_scale"):
            kv.load_kv_scales({names[0]: Attention(bad, 1.0)})
    with pytest.raises(TypeError, match="v_scale"):
        kv.load_kv_scales({names[0]: Attention(1.0, "2")})
    assert kv.kv_scales[names[0]] == (0.5, 2.0)  # a refused call changes nothing


@pytest.mark.parametrize("mode", PER_TOKEN_HEAD)
def test_each_layer_gets_its_own_scale_view_in_its_metadata(mode):
    kv = make_quant_cache(mode, "BLNHC")
    metadata = _step(kv, [1], [1], [[1]])
    for name, scales in kv.scale_caches.items():
        state = metadata[name].kv_quant
        assert state.scale_cache is scales and state.kv_quant == "per_token_head"
        assert state.dtype == MODES[mode][0]
    assert len({id(m) for m in metadata.values()}) == len(metadata)
    plain = KVCache.create(layer_specs(), dict.fromkeys(layer_specs(), "torch"), device="cpu", num_blocks=4,
                           max_num_seqs=1, max_model_len=32, plugin_manager=torch_only())
    shared = _step(plain, [1], [1], [[1]])
    assert len({id(m) for m in shared.values()}) == 1 and next(iter(shared.values())).kv_quant is None


class _NoQuantBackend(TorchAttentionBackend):
    name: ClassVar[str] = "test-no-quant"


class _PerTensorBackend(TorchAttentionBackend):
    name: ClassVar[str] = "test-per-tensor"


class _Plugin:
    @hookimpl
    def kvcore_register_backends(self, register):
        register(_NoQuantBackend)
        register(_PerTensorBackend)

    @hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        if backend is _PerTensorBackend:
            return KernelRequirements(kv_quant=("none", "per_tensor"))
        return None


def _manager():
    pm = get_plugin_manager(autoload=False)
    pm.register(_Plugin(), name="test-quant-backends")
    return pm


@pytest.mark.parametrize("mode", MODES)
def test_a_backend_that_does_not_take_the_mode_is_refused_and_auto_skips_it(mode):
    specs = layer_specs(num_layers=1)
    with pytest.raises(KernelRequirementError, match=r"'test-no-quant'.*kv_quant"):
        KVCache.create(specs, dict.fromkeys(specs, "test-no-quant"), device="cpu", num_blocks=4, max_num_seqs=1,
                       max_model_len=32, plugin_manager=_manager(), kv_cache_dtype=mode)
    per_tensor = MODES[mode][1] == "per_tensor"
    if not per_tensor:
        with pytest.raises(KernelRequirementError, match=r"'test-per-tensor'.*kv_quant"):
            KVCache.create(specs, dict.fromkeys(specs, "test-per-tensor"), device="cpu", num_blocks=4,
                           max_num_seqs=1, max_model_len=32, plugin_manager=_manager(), kv_cache_dtype=mode)
    def auto():
        return KVCache.create(specs, dict.fromkeys(specs, "auto"), device="cpu", num_blocks=4, max_num_seqs=1,
                              max_model_len=32, plugin_manager=_manager(), kv_cache_dtype=mode)

    if per_tensor:  # "auto" picks the one backend that takes the mode
        assert auto().group_of(next(iter(specs))).backend is _PerTensorBackend
    else:  # none does: the refusal lists why each cannot
        with pytest.raises(ValueError, match=r"test-no-quant: takes kv_quant none, not per_token_head"):
            auto()


def test_unknown_modes_are_refused_before_anything_is_allocated(monkeypatch):
    import kvcore.memory.views as views

    allocated = []
    monkeypatch.setattr(views, "_zeroed_buffer", lambda *a: allocated.append(a))
    specs = layer_specs()
    for bad in ("fp4", "int8", 8):
        with pytest.raises((ValueError, TypeError), match="kv_cache_dtype"):
            KVCache.create(specs, dict.fromkeys(specs, "torch"), device="cpu", num_blocks=4, max_num_seqs=1,
                           max_model_len=32, plugin_manager=torch_only(), kv_cache_dtype=bad)
    assert allocated == []


class _OpaqueBuilder(AttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, **kwargs):
        return {"batch": common_attn_metadata}


class _OpaqueBackend(TorchAttentionBackend):
    name: ClassVar[str] = "test-opaque-metadata"

    @classmethod
    def get_builder_cls(cls):
        return _OpaqueBuilder


class _OpaquePlugin:
    @hookimpl
    def kvcore_register_backends(self, register):
        register(_OpaqueBackend)

    @hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        if backend is _OpaqueBackend:
            return KernelRequirements(kv_quant=("none", "per_tensor", "per_token_head"))
        return None


def test_metadata_without_a_kv_quant_field_is_refused_naming_it():
    pm = get_plugin_manager(autoload=False)
    pm.register(_OpaquePlugin(), name="test-opaque")
    specs = layer_specs(num_layers=1)
    kv = KVCache.create(specs, dict.fromkeys(specs, "test-opaque-metadata"), device="cpu", num_blocks=4,
                        max_num_seqs=1, max_model_len=32, plugin_manager=pm, kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="dict.*kv_quant"):
        _step(kv, [1], [1], [[1]])


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("mode", PER_TOKEN_HEAD)
def test_elastic_resize_commits_data_and_scales_together(mode, layout):
    kv = make_quant_cache(mode, layout, num_blocks=3, max_num_blocks=9)
    for n in (3, 9, 5, 2):
        kv.resize(n)
        covered = torch.zeros(raw(kv).numel(), dtype=torch.bool)
        for start, end in kv.elastic._committed:
            covered[start:end] = True
        assert covered[block_byte_mask(kv, range(n))].all(), n
        ids = kv.block_pool.allocate(n - 1)
        kv.begin_step()  # NOTE: the grown blocks' data and scales are committed and zeroed
        assert (raw(kv)[block_byte_mask(kv, ids)] == 0).all()
        kv.block_pool.free(ids)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", PER_TOKEN_HEAD)
def test_scales_add_no_zeroer_segment(mode, layout):
    # NOTE: a page's scales touch its data runs, so they merge into the same segments: the
    # zeroer's launch geometry and host work per call stay those of an unquantized cache.
    plain, quantized = make_quant_cache("auto", layout), make_quant_cache(mode, layout)
    segments = [[len(a.segments) for a in kv.zeroer._allocations] for kv in (plain, quantized)]
    assert segments[0] == segments[1]
    pages = [sum(s.page for a in kv.zeroer._allocations for s in a.segments) for kv in (plain, quantized)]
    # float32 rows of 2 x 16 values (128 bytes) against 8-bit rows (32 bytes) and their 8 scale bytes
    assert pages[1] * 128 == pages[0] * (32 + 8)


@pytest.mark.parametrize("mode", MODES)
def test_the_negotiation_stage_decides_on_quantized_specs_and_allocates_nothing(mode, monkeypatch):
    import kvcore.memory.views as views

    allocated = []
    monkeypatch.setattr(views, "_zeroed_buffer", lambda *a: allocated.append(a))
    specs = layer_specs()
    negotiation = kvcore.negotiate(specs, dict.fromkeys(specs, "auto"), device="cpu", num_blocks=6, max_num_seqs=1,
                                   max_model_len=32, plugin_manager=torch_only(), kv_cache_dtype=mode)
    spec = negotiation.config.kv_cache_groups[0].kv_cache_spec
    assert (spec.dtype, spec.kv_quant) == MODES[mode] and allocated == []
    assert "kv_quant" in negotiation.explain()
