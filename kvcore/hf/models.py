"""Models to serve: small random-weight ones from configs (no download), or a local checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from kvcore.hf.tp import load_tp_model

_MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
           "mamba_chunk_size": 16, "mamba_expand": 2}
_GRANITE = {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], **_MAMBA2}

#: Architecture name -> (config class, keyword arguments beyond the common small shape).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 24}),
    "gemma3": (
        "Gemma3TextConfig",
        {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24},
    ),
    # Hybrids: mixer layers around one attention layer (three layers; Mamba2 mixers of 8 heads of 16).
    "bamba": ("BambaConfig", {"num_hidden_layers": 3, "attn_layer_indices": [1], **_MAMBA2}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {**_GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64},
    ),
    "granitemoehybrid-dense": (
        "GraniteMoeHybridConfig", {**_GRANITE, "num_local_experts": 0, "shared_intermediate_size": 128}
    ),
    "falcon_h1": ("FalconH1Config", {"mamba_d_ssm": 128, **_MAMBA2}),
    "nemotron_h": (
        "NemotronHConfig",
        {"num_hidden_layers": 4, "hybrid_override_pattern": "M*-M", "mamba_num_heads": 8, "mamba_head_dim": 16,
         "n_groups": 1, "ssm_state_size": 8, "chunk_size": 16},
    ),
    "lfm2": ("Lfm2Config", {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]}),
    "qwen3_next": (
        "Qwen3NextConfig",
        {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 32},
    ),
}


def model_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A small config of ``arch`` (hidden 64, 2 layers, 4 query / 2 KV heads of 16, vocab 256)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    class_name, extra = ARCHITECTURES[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    if "layer_types" in kwargs and kwargs["num_hidden_layers"] != len(kwargs["layer_types"]):
        pattern = kwargs["layer_types"]
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(kwargs["num_hidden_layers"])]
    return getattr(transformers, class_name)(**kwargs)


def random_model(
    config: transformers.PretrainedConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    seed: int = 0, logit_std: float = 8.0,
) -> transformers.PreTrainedModel:
    """A random-weight causal LM for ``config`` with logits of about ``logit_std`` spread: peaky, so
    that rounding that differs between two exact attention implementations cannot flip a token."""
    device = torch.device(device)
    torch.manual_seed(seed)
    with device:  # NOTE: weights are drawn where they live (a 1B model initializes in seconds on a GPU)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.normal_(0.0, logit_std / config.hidden_size**0.5, generator=torch.Generator(device).manual_seed(seed))
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def load_model(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str = "cpu") -> Any:
    """A local checkpoint directory (``from_pretrained`` with local files only)."""
    return load_tp_model(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
