"""The memory of an engine's largest step: a prefill call's rows are capped so that a module that
pads its chunk scan stays within the step budget in one row, and on a GPU the default cache is
sized after measuring that step (so serving never needs more than what was left)."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

from kvcore.errors import InsufficientMemoryError  # noqa: E402
from kvcore.hf import Engine  # noqa: E402
from kvcore.hf import profile as step_profile  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore_torch import TorchMixerBackend  # noqa: E402


def counting_backend(engine, calls):
    """Record every prefill call's (rows, tokens) on each of ``engine``'s mixer layers."""

    def batch(layer, hidden_states, states, slot_ids):
        calls.append(tuple(hidden_states.shape[:2]))
        return TorchMixerBackend.prefill_batch(layer, hidden_states, states, slot_ids)

    def one(layer, hidden_states, states, slot_id):
        calls.append((1, hidden_states.shape[0]))
        return TorchMixerBackend.prefill(layer, hidden_states, states, slot_id)

    counting = type("Counting", (TorchMixerBackend,), {"prefill_batch": staticmethod(batch),
                                                        "prefill": staticmethod(one)})
    for layer in engine.mixers.layers.values():
        layer.backend = counting


@pytest.mark.parametrize("budget, calls", [(32, [(2, 5), (2, 5), (1, 5)]), (48, [(3, 5), (2, 5)]), (80, [(5, 5)])])
def test_equal_length_chunks_are_batched_only_up_to_the_step_budget_in_padded_tokens(budget, calls):
    # NOTE: the model's Mamba2 chunk scan pads each row to 16 tokens: five 5-token prompts cost 80
    model = random_model(model_config("bamba"), seed=5)
    assert model.model.layers[0].mamba.chunk_size == 16
    prompts = prompts_for([5] * 5, seed=4)
    engine = Engine(model, num_blocks=16, max_num_seqs=5, max_num_batched_tokens=budget)
    seen = []
    counting_backend(engine, seen)
    assert engine.generate(prompts, 3) == reference(model, prompts, 3)
    assert seen[: len(calls)] == calls and len(seen) == len(calls) * len(engine.mixers.layers)


def test_the_cache_takes_nine_tenths_of_what_the_largest_step_and_a_margin_leave():
    gib = 1 << 30
    assert step_profile.cache_share(40 * gib, 5 * gib, 4096) == int((40 - 5 - 1) * gib * 0.9)
    with pytest.raises(InsufficientMemoryError, match=r"a step of 4096 tokens \(max_num_batched_tokens\) needs "
                                                      r"39.50 GiB .* 40.00 GiB free.* lower max_num_batched_tokens"):
        step_profile.cache_share(40 * gib, 39 * gib + gib // 2, 4096)


def test_a_cpu_engine_keeps_its_256_mib_default_without_measuring(monkeypatch):
    monkeypatch.setattr(step_profile, "step_peak", lambda *a: pytest.fail("no step is measured on a CPU"))
    engine = Engine(random_model(model_config("granitemoehybrid")), max_num_seqs=2)
    assert engine.kv.config.num_blocks > 1 and engine.kv.kv_caches


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch, mixer_backend", [("granitemoehybrid", "torch-mixer"),
                                                 ("granitemoehybrid", "triton-mixer"), ("llama", "auto")])
def test_gpu_default_cache_leaves_room_for_every_step(arch, mixer_backend, monkeypatch):
    # NOTE: 256-token chunks of 16 heads of 32 x 64: transformers' reference scan (5.17) multiplies out
    # [256, 256, heads, state] per chunk; the engine's steps (42 prompts of 24 tokens, each row padded to
    # 256) must need no more than the one-row step of 1024 tokens it measured before the cache
    extra = {"mamba_n_heads": 16, "mamba_d_head": 32, "mamba_d_state": 64, "mamba_chunk_size": 256,
             "hidden_size": 256} if arch != "llama" else {}
    model = random_model(model_config(arch, **extra), seed=6, device="cuda")
    model.generation_config.eos_token_id = None  # NOTE: every request runs its 4 tokens
    measured = []
    peak = step_profile.step_peak
    monkeypatch.setattr(step_profile, "step_peak", lambda *a: measured.append(peak(*a)) or measured[-1])
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    # NOTE: the triton attention backend named: another plugin's may keep workspaces it makes at the first step
    engine = Engine(model, backend="triton", max_num_seqs=64, max_num_batched_tokens=1024, mixer_backend=mixer_backend)
    try:
        (step,) = measured
        storage = next(iter(engine.kv.kv_caches.values())).untyped_storage().nbytes()
        assert 0 < step < free and storage <= step_profile.cache_share(free, step, 1024) * 1.01
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outputs = engine.generate(prompts_for([24] * 48, seed=7), 4)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= step + (64 << 20)
        assert len(outputs) == 48 and all(len(o) == 4 for o in outputs)
    finally:  # NOTE: most of the GPU's memory: given back before the next test
        del engine
        gc.collect()
        torch.cuda.empty_cache()
