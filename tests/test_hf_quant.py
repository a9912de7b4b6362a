"""kvcore.hf.Engine serves every quantized cache mode: tokens against the same engine's
unquantized cache (tiny float32 models), prefix caching, scales from the model, triton too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

PROMPT_LENS = [5, 40, 17, 33, 9, 26, 12, 50, 3, 22, 31, 8, 14, 19, 27, 6]
MAX_NEW = 8
#: Least share of requests whose greedy tokens equal the unquantized cache's, per mode, on this
#: 2-layer random model (observed on CPU: int8_per_token_head 15/16, fp8_per_token_head 12/16,
#: fp8 11/16, fp8_e5m2 6/16). A random model's logits are close, so 8-bit rounding flips some
#: greedy picks; fewer mantissa bits flip more.
LEAST_SHARE = {"int8_per_token_head": 0.75, "fp8_per_token_head": 0.5, "fp8": 0.5, "fp8_e5m2": 0.25}


def prompts_for(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama():
    model = random_model(model_config("llama"), seed=1)
    prompts = prompts_for(PROMPT_LENS)
    baseline = Engine(model, backend="torch", num_blocks=14, max_num_seqs=4).generate(prompts, MAX_NEW)
    return model, prompts, baseline


@pytest.mark.parametrize("mode", list(LEAST_SHARE))
def test_each_mode_serves_most_requests_with_the_unquantized_caches_tokens(llama, mode, capsys):
    model, prompts, baseline = llama
    engine = Engine(model, backend="torch", num_blocks=14, max_num_seqs=4, kv_cache_dtype=mode)
    out = engine.generate(prompts, MAX_NEW)
    assert [len(o) for o in out] == [MAX_NEW] * len(prompts)
    same = sum(a == b for a, b in zip(out, baseline))
    with capsys.disabled():
        print(f"\n{mode}: {same}/{len(prompts)} requests' greedy tokens equal the unquantized cache's")
    assert same >= LEAST_SHARE[mode] * len(prompts)
    assert engine.stats().blocks_allocated > engine.kv.num_blocks - 1  # blocks were recycled
    # NOTE: the engine's pool blocks hold 8-bit values (and scales), not float32 ones.
    spec = engine.kv.config.kv_cache_groups[0].kv_cache_spec
    assert spec.dtype.itemsize == 1 and spec.kv_quant in ("per_tensor", "per_token_head")


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8"])
def test_prefix_caching_over_a_quantized_cache_changes_no_token(llama, mode):
    model, _, _ = llama
    common = prompts_for([48], seed=5)[0]
    prompts = [common + p for p in prompts_for([7, 12, 3, 9], seed=6)]
    kwargs = dict(backend="torch", num_blocks=40, max_num_seqs=1, kv_cache_dtype=mode)
    off = Engine(model, **kwargs).generate(prompts, MAX_NEW)
    cached = Engine(model, enable_prefix_caching=True, **kwargs)
    assert cached.generate(prompts, MAX_NEW) == off
    assert cached.stats().prefix_cache_hit_tokens >= 3 * 48 - 3 * 16  # whole blocks of the prefix


def test_per_tensor_scales_come_from_the_attention_modules(llama):
    model, prompts, _ = llama
    layers = model.model.layers
    try:
        for i, layer in enumerate(layers):
            layer.self_attn.k_scale, layer.self_attn.v_scale = 0.5 + i, torch.tensor(0.25)
        engine = Engine(model, backend="torch", num_blocks=14, max_num_seqs=4, kv_cache_dtype="fp8")
        assert engine.kv.kv_scales == {f"model.layers.{i}.self_attn": (0.5 + i, 0.25) for i in range(len(layers))}
        assert all(len(o) == MAX_NEW for o in engine.generate(prompts[:4], MAX_NEW))
    finally:
        for layer in layers:
            del layer.self_attn.k_scale, layer.self_attn.v_scale


def test_a_bad_mode_is_refused_before_the_engine_is_built(llama):
    model, _, _ = llama
    with pytest.raises(ValueError, match="fp8_per_token_head"):
        Engine(model, backend="torch", num_blocks=40, kv_cache_dtype="fp4")


@pytest.mark.parametrize("mode", ["fp8", "int8_per_token_head"])
def test_triton_through_the_interpreter_matches_the_torch_reference(mode):
    # NOTE: both backends store the same bytes (one quantization), so their tokens agree.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(model_config("gemma3"), seed=1, device=device)
    prompts = prompts_for([21, 6, 30], seed=3)
    kwargs = dict(block_size=16, num_blocks=7, max_num_seqs=2, max_num_batched_tokens=16, cuda_graphs=False,
                  kv_cache_dtype=mode)
    expected = Engine(model, backend="torch", **kwargs).generate(prompts, 4)
    engine = Engine(model, backend="triton", **kwargs)
    assert engine.generate(prompts, 4) == expected
    assert engine.kv.scale_caches or engine.kv.kv_scales
