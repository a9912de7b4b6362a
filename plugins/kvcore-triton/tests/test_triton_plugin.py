"""The ``triton`` entry point: fixed kernel block sizes drive block splitting end to end."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from triton_paged_cases import DEVICE, build_cache, dense_reference, make_batch

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins import get_plugin_manager
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.plugins.block_sizes import customize_attention_spec, select_common_block_size
from kvcore.plugins.registry import get_backend
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.specs import FullAttentionSpec, MultipleOf
from kvcore_triton import KernelConfig, TritonAttentionBackend
from kvcore_triton import plugin as triton_plugin

SPEC = FullAttentionSpec(128, 2, 16, torch.float32)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def test_entry_point_is_declared_and_loaded(pm):
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcore.plugins")}
    assert eps.get("triton") == "kvcore_triton.plugin"
    assert get_backend("triton", plugin_manager=pm) is TritonAttentionBackend
    assert pm.plugin_infos["triton"].status == "loaded"


def test_fixed_kernel_block_sizes(pm):
    assert pm.hook.kvcore_supported_kernel_block_sizes(backend=TritonAttentionBackend, spec=SPEC) == [64, 32, 16]
    def pick(size):
        return select_common_block_size(size, [TritonAttentionBackend], [SPEC], plugin_manager=pm)

    assert [pick(s) for s in (16, 64, 128, 48, 256)] == [16, 64, 64, 16, 64]
    with pytest.raises(ValueError, match="No common block size"):
        pick(40)
    # Packed blocks must keep whole 64-token kernel blocks.
    customized = customize_attention_spec(TritonAttentionBackend, SPEC, plugin_manager=pm)
    assert customized.block_stride_alignment == MultipleOf(64)


def test_layouts_block_compact_first(pm):
    layouts = pm.hook.kvcore_supported_layouts(backend=TritonAttentionBackend, spec=SPEC)
    assert layouts[:2] == [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC] and len(set(layouts)) == 6


def test_other_backends_get_no_answer():
    class Other(TritonAttentionBackend):
        name = "other"

    assert triton_plugin.kvcore_supported_kernel_block_sizes(backend=Other, spec=SPEC) is None
    assert triton_plugin.kvcore_supported_layouts(backend=Other, spec=SPEC) is None


def test_forward_through_an_attention_group(pm):
    """128-token manager blocks reach the kernels as 64-token kernel blocks via kvcore's mapping."""
    group = AttentionGroup(TritonAttentionBackend, ["model.layers.0.attn"], SPEC, 0)
    group.create_metadata_builders(DEVICE, max_num_seqs=4, max_model_len=512, kernel_block_size=128, plugin_manager=pm)
    assert group.kernel_block_size == 64
    view, _ = build_cache(KVCacheLayout.LBNHC, 128, 6, 2, 16, torch.float32, kernel_block_size=64)
    seq_lens, q_lens = [40, 150], [3, 1]
    batch = make_batch(torch.Generator().manual_seed(7), seq_lens, q_lens, kv_heads=2, q_heads=4, head_size=16,
                       dtype=torch.float32, num_blocks=6, block_size=128, ratio=2)
    prefix = batch.slots(64, new_only=False).to(DEVICE)
    keys, values = batch.tokens(batch.keys, False).to(DEVICE), batch.tokens(batch.values, False).to(DEVICE)
    TritonAttentionBackend.write_kv(view, keys, values, prefix, 16)
    # The slot mapping of new tokens uses manager blocks: b * 128 + offset.
    slots = torch.tensor([int(batch.manager_table[i, p // 128]) * 128 + p % 128
                          for i, (n, q) in enumerate(zip(seq_lens, q_lens)) for p in range(n - q, n)])
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc.to(DEVICE), seq_lens=batch.seq_lens_tensor.to(DEVICE),
        block_table_tensor=batch.manager_table.to(DEVICE), slot_mapping=slots.to(DEVICE), num_reqs=2,
        num_actual_tokens=4, max_query_len=3, max_seq_len=150,
    )
    metadata = group.build_metadata(common)
    assert torch.equal(metadata.block_table_tensor.cpu(), batch.kernel_table)
    new_keys, new_values = batch.tokens(batch.keys, True).to(DEVICE), batch.tokens(batch.values, True).to(DEVICE)
    out = TritonAttentionBackend.forward(
        batch.query.to(DEVICE), new_keys, new_values, view, metadata,
        head_size=16, scale=0.25, config=KernelConfig(tile=16),
    )
    torch.testing.assert_close(out.cpu().double(), dense_reference(batch, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter serves CPU tensors")
def test_an_interpreter_that_cannot_run_loops_hands_cpu_and_auto_to_the_torch_backend(monkeypatch):
    from kvcore_triton import _checks

    assert _checks._interpreter_problem() is None  # NOTE: the probe's loop ran right under this interpreter
    problem = "the interpreter of Triton 3.6.0 fails on a kernel loop here (TypeError: ...)"
    monkeypatch.setattr(_checks, "INTERPRETER_PROBLEM", problem)
    monkeypatch.setattr(_checks, "INTERPRETED", False)
    req = triton_plugin.kvcore_kernel_requirements(backend=TritonAttentionBackend, spec=SPEC)
    why = req.why_not("cpu", SPEC.dtype, SPEC.head_size)
    assert why is not None and problem in why and "'torch' backend" in why
    # NOTE: the interpreter, when on, runs CUDA tensors' kernels too: "auto" prefers any other backend there
    priority = triton_plugin.kvcore_backend_priority(backend=TritonAttentionBackend, spec=SPEC,
                                                     device=torch.device("cuda"))
    assert priority < 0
    from kvcore_triton.mixers import TritonMixerBackend

    mixer = triton_plugin.kvcore_kernel_requirements(backend=TritonMixerBackend, spec=SPEC)
    assert problem in mixer.why_not("cpu", SPEC.dtype, None)
    assert triton_plugin.kvcore_backend_priority(backend=TritonMixerBackend, spec=SPEC,
                                                 device=torch.device("cuda")) < 0
    with pytest.raises(ValueError, match="fails on a kernel loop.*'torch' backend.*unset TRITON_INTERPRET"):
        _checks.check_device(torch.zeros(2, 1, 16, 32))
