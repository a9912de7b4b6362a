"""kvcore-flashinfer over quantized caches: per-tensor fp8 through FlashInfer's ``kv_data_type`` with
``k_scale``/``v_scale`` at run time (CPU: ``fake_flashinfer``); per-token-head caches refused."""

from __future__ import annotations

import fake_flashinfer
import pytest
import torch

import kvcore_torch
from kvcore import FullAttentionSpec, KVCache, get_plugin_manager, plan_kv_cache
from kvcore.errors import KernelRequirementError
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.backend import CommonAttentionMetadata, KVQuantState
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs.quant import quantize_specs
from kvcore.testing import make_batch
from kvcore_flashinfer import FlashInferAttentionBackend, FlashInferMetadataBuilder
from kvcore_flashinfer import plugin as fi_plugin

SPEC = FullAttentionSpec(16, 2, 64, torch.bfloat16)


@pytest.mark.parametrize("mode", ["fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"])
def test_declares_per_tensor_fp8_only(mode):
    spec = quantize_specs({"a": SPEC}, mode)["a"]
    req = get_plugin_manager(autoload=False)
    req.register(fi_plugin, name="flashinfer")
    answer = req.hook.kvcore_kernel_requirements(backend=FlashInferAttentionBackend, spec=spec)
    why = answer.why_not("cuda", spec.dtype, 64, spec.kv_quant)
    if spec.kv_quant == "per_tensor":
        assert why is None and set(answer.dtypes) == {torch.float8_e4m3fn, torch.float8_e5m2}
    else:
        assert "rule: kv_quant" in why
        specs = {"layer": SPEC}
        with pytest.raises(KernelRequirementError, match=r"'flashinfer'.*kv_quant"):
            KVCache.create(specs, {"layer": "flashinfer"}, device="cpu", num_blocks=4, max_num_seqs=1,
                           max_model_len=32, plugin_manager=req, kv_cache_dtype=mode)
    plain = req.hook.kvcore_kernel_requirements(backend=FlashInferAttentionBackend, spec=SPEC)
    assert plain.why_not("cuda", torch.bfloat16, 64) is None


@pytest.fixture
def fake(monkeypatch):
    for where in ("_runtime", "builder", "backend"):
        monkeypatch.setattr(f"kvcore_flashinfer.{where}.flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr("kvcore_flashinfer.backend.check_view", lambda view, head_size, head_size_v: None)
    monkeypatch.setattr("kvcore_flashinfer.builder._workspace", lambda device: None)
    # NOTE: CPU tensors: the reference store writes K/V (kvcore-triton's needs the Triton interpreter)
    monkeypatch.setattr("kvcore_flashinfer.backend._store", lambda: kvcore_torch.write_kv)


@pytest.mark.parametrize("mode", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_fp8_cache_is_planned_as_fp8_and_run_with_the_layers_scales(fake, mode, layout):
    spec = quantize_specs({"a": FullAttentionSpec(16, 2, 16, torch.float32)}, mode)["a"]
    view = allocate_kv_cache(plan_kv_cache({"a": spec}, layout, num_blocks=9), "cpu")["a"]
    state = KVQuantState("per_tensor", spec.dtype, 0.5, 2.0)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [17, 40, 9], [17, 6, 1], kv_heads=2, q_heads=4, head_size=16, dtype=torch.float32,
                       num_blocks=9, block_size=16)
    kvcore_torch.write_kv(view, batch.tokens(batch.keys, False), batch.tokens(batch.values, False),
                          batch.slots(16, False), 16, kv_quant=state)
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_tensor, block_table_tensor=batch.kernel_table,
        slot_mapping=batch.slots(16, True), num_reqs=3, num_actual_tokens=24, max_query_len=17, max_seq_len=40)
    builder = FlashInferMetadataBuilder(spec, ["a"], "cpu", max_num_seqs=4, max_model_len=64)
    import attrs

    metadata = attrs.evolve(builder.build(0, common), kv_quant=state)
    query = batch.query.to(torch.bfloat16)
    out = FlashInferAttentionBackend.forward(query, batch.tokens(batch.keys, True), batch.tokens(batch.values, True),
                                             view, metadata, head_size=16, scale=0.25)
    (key, wrapper), = metadata.planned.items()
    assert key.dtype == torch.bfloat16 and key.kv_dtype == spec.dtype
    assert (wrapper.q_data_type, wrapper.kv_data_type) == (torch.bfloat16, spec.dtype)
    ref = kvcore_torch.paged_attention(query.float(), view, batch.kernel_table, batch.query_start_loc,
                                       batch.seq_lens_tensor, head_size=16, scale=0.25, kv_quant=state)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(Exception, match="per tensor"):  # per-token-head state on an fp8 view
        FlashInferAttentionBackend.forward(query, query[:, :2], query[:, :2], view,
                                           attrs.evolve(metadata, kv_quant=KVQuantState("per_token_head", spec.dtype)),
                                           head_size=16, scale=0.25)


def test_requirements_of_the_fake_fixture_keep_kv_quant(monkeypatch):
    # NOTE: the other fake tests swap REQUIREMENTS for an empty one; quantized specs then ask
    # for the fp8 dtypes on top of whatever REQUIREMENTS says.
    monkeypatch.setattr(fi_plugin, "REQUIREMENTS", KernelRequirements(kv_quant=("none", "per_tensor")))
    spec = quantize_specs({"a": SPEC}, "fp8")["a"]
    answer = fi_plugin.kvcore_kernel_requirements(backend=FlashInferAttentionBackend, spec=spec)
    assert answer.kv_quant == ("none", "per_tensor") and torch.float8_e4m3fn in answer.dtypes
