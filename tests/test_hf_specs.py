"""specs_from_config: one spec per decoder layer named by module path; unservable features refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvcore import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from kvcore.hf import specs_from_config  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402


def test_gemma3_layers_follow_layer_types_with_the_configs_heads():
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=4, head_dim=32, sliding_window=512,
        hidden_size=128, intermediate_size=256, vocab_size=64,
    )
    specs = specs_from_config(config, dtype=torch.bfloat16, block_size=32)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(7)]
    kinds = [type(s) for s in specs.values()]
    # Gemma 3's default pattern: five sliding layers, then one full one.
    assert kinds == [SlidingWindowSpec] * 5 + [FullAttentionSpec] + [SlidingWindowSpec]
    first = specs["model.layers.0.self_attn"]
    assert (first.block_size, first.num_kv_heads, first.head_size, first.dtype) == (32, 4, 32, torch.bfloat16)
    assert first.sliding_window == 512


def test_model_order_and_names_match_the_models_attention_modules():
    model = random_model(model_config("qwen3", num_hidden_layers=3))
    modules = {n for n, _ in model.named_modules()}
    assert set(specs_from_config(model.config)) <= modules


@pytest.mark.parametrize(
    "config, kind, window",
    [
        (transformers.LlamaConfig(num_hidden_layers=2, head_dim=64), FullAttentionSpec, None),
        (transformers.MistralConfig(num_hidden_layers=2, sliding_window=100), SlidingWindowSpec, 100),
        (transformers.MistralConfig(num_hidden_layers=2, sliding_window=None), FullAttentionSpec, None),
        (transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=False), FullAttentionSpec, None),
    ],
)
def test_windows_come_from_the_config(config, kind, window):
    specs = list(specs_from_config(config).values())
    assert all(type(s) is kind for s in specs)
    assert all(getattr(s, "sliding_window", None) == window for s in specs)


def test_qwen2_sliding_layers_from_max_window_layers():
    config = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                      max_window_layers=2)
    kinds = [type(s) for s in specs_from_config(config).values()]
    assert kinds == [FullAttentionSpec if t == "full_attention" else SlidingWindowSpec for t in config.layer_types]
    assert FullAttentionSpec in kinds and SlidingWindowSpec in kinds


def test_head_dim_defaults_to_hidden_over_heads_and_dtype_to_the_config():
    config = transformers.Qwen2Config(num_hidden_layers=1, hidden_size=256, num_attention_heads=8,
                                      num_key_value_heads=2, dtype="float16")
    (spec,) = specs_from_config(config).values()
    assert (spec.head_size, spec.num_kv_heads, spec.dtype) == (32, 2, torch.float16)


def test_chunked_local_attention_is_described():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config.attention_chunk_size = 128
    specs = list(specs_from_config(config).values())
    assert all(isinstance(s, ChunkedLocalAttentionSpec) and s.attention_chunk_size == 128 for s in specs)


def _with_layer_types(config, types):
    config.layer_types = types  # a model type kvcore serves no mixer of
    return config


@pytest.mark.parametrize(
    "make, feature",
    [
        (lambda: transformers.Gemma2Config(num_hidden_layers=2), "attention logit soft-capping"),
        (lambda: transformers.GptOssConfig(num_hidden_layers=2), "attention sinks"),
        (lambda: transformers.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2),
         "cross-layer KV sharing"),
        (lambda: transformers.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True),
         "bidirectional attention"),
        (lambda: transformers.DeepseekV3Config(num_hidden_layers=2), "multi-head latent attention"),
        (lambda: _with_layer_types(transformers.LlamaConfig(num_hidden_layers=2),
                                   ["linear_attention", "full_attention"]), "layer types"),
    ],
)
def test_features_no_backend_implements_are_refused_by_name(make, feature):
    with pytest.raises(ValueError, match=feature):
        specs_from_config(make())


def test_a_capped_gemma3_is_refused_and_an_uncapped_one_is_not():
    config = transformers.Gemma3TextConfig(num_hidden_layers=2, attn_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"soft-capping \(attn_logit_softcapping=30.0\)"):
        specs_from_config(config)
    config.attn_logit_softcapping = None
    assert len(specs_from_config(config)) == 2


@pytest.mark.parametrize("bad, error", [({"block_size": 0}, ValueError), ({"dtype": "int8"}, TypeError)])
def test_bad_arguments(bad, error):
    with pytest.raises(error):
        specs_from_config(transformers.LlamaConfig(num_hidden_layers=1), **bad)


def test_import_kvcore_does_not_import_transformers():
    code = "import sys, kvcore; kvcore.KVCache; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
