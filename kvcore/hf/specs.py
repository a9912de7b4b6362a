"""KV cache specs of a transformers decoder config, and what kvcore refuses to serve.

Every decoder layer gets one spec named after its attention module
(``model.layers.<i>.self_attn``): full attention, a sliding window (``layer_types`` /
``sliding_window``) or chunked local attention, with the config's KV heads and head dim; a
hybrid's mixer layers get a state spec (:mod:`kvcore.hf.hybrid`). Features no kvcore backend
implements are refused with a ``ValueError`` naming them: a model is never served approximately.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore._validate import positive_int
from kvcore.specs.attention import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from kvcore.specs.base import KVCacheSpec
from kvcore.hf.hybrid import HYBRID_FAMILIES, hybrid_layer_roles, is_hybrid, mixer_spec, refuse_unservable_hybrid

#: ``model_type`` values whose transformers modeling code the engine serves (tested for exactness).
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", *HYBRID_FAMILIES)

_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def unsupported_features(config: Any) -> list[str]:
    """Attention features of ``config`` that kvcore's backends do not implement, in words."""
    found = []
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        found.append(f"attention logit soft-capping (attn_logit_softcapping={cap})")
    if getattr(config, "model_type", None) == "gpt_oss" or getattr(config, "attention_sinks", None):
        found.append("attention sinks (learned per-head sink logits)")
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared:
        found.append(f"cross-layer KV sharing (num_kv_shared_layers={shared})")
    if getattr(config, "use_bidirectional_attention", False):
        found.append("bidirectional attention (use_bidirectional_attention=True)")
    if getattr(config, "kv_lora_rank", None):
        found.append(f"multi-head latent attention (kv_lora_rank={config.kv_lora_rank})")
    others = sorted({t for t in (getattr(config, "layer_types", None) or ()) if t not in _LAYER_TYPES})
    if others and not is_hybrid(config):
        found.append(f"layer types {others} (kvcore serves {list(_LAYER_TYPES)})")
    return found


def check_servable(config: Any) -> None:
    """Raise ``ValueError`` naming every attention feature of ``config`` kvcore cannot serve exactly."""
    refuse_unservable_hybrid(config)
    found = unsupported_features(config)
    if found:
        kind = getattr(config, "model_type", type(config).__name__)
        raise ValueError(
            f"kvcore cannot serve this {kind} config exactly: it uses {'; '.join(found)}. "
            "No kvcore backend implements that; use a model without it"
        )


def check_model(model: Any) -> None:
    """Refuse a model the engine cannot serve token for token (``TypeError`` / ``ValueError``)."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise TypeError(f"model must be a transformers causal LM (a torch.nn.Module with a config), got {model!r}")
    check_servable(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in SERVED_MODEL_TYPES:
        raise ValueError(
            f"kvcore.hf serves the model types {list(SERVED_MODEL_TYPES)}; {type(model).__name__} is "
            f"{model_type!r}, whose modeling code kvcore has not verified token for token"
        )
    if not is_hybrid(config):
        chunked = [i for i, t in enumerate(_layer_types(config)) if t == "chunked_attention"]
        if chunked:
            raise ValueError(
                f"model.layers.{chunked[0]}.self_attn uses chunked local attention, which no kvcore backend "
                "implements"
            )


def model_modules(model: torch.nn.Module, names: list[str]) -> dict[str, torch.nn.Module]:
    """The modules of ``model`` that hold a KV cache or a state, by path (``ValueError`` if missing)."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"{type(model).__name__} has no attention modules {missing[:2]}...; pass the "
            "*ForCausalLM model (its decoder layers are model.layers.<i>)"
        )
    return {n: modules[n] for n in names}


def _layer_types(config: Any) -> list[str]:
    """``config.layer_types``; without them (Llama, Mistral) one type, window or chunk if any, for every layer."""
    num_layers = positive_int("config.num_hidden_layers", getattr(config, "num_hidden_layers", None))
    types = getattr(config, "layer_types", None)
    if types is None:
        chunk, window = getattr(config, "attention_chunk_size", None), getattr(config, "sliding_window", None)
        types = ["chunked_attention" if chunk else "sliding_attention" if window else "full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(
            f"config.layer_types lists {len(types)} layers but num_hidden_layers={num_layers}; "
            "give one type per layer"
        )
    return list(types)


def specs_from_config(
    config: Any, dtype: torch.dtype | str | None = None, block_size: int = 16
) -> dict[str, KVCacheSpec]:
    """One KV cache spec per decoder layer of ``config``, in model order, keyed by module path.

    :param config: a transformers ``PretrainedConfig`` of a decoder-only model.
    :param dtype: the cache dtype; None takes the config's ``dtype`` (float32 if unset).
    :param block_size: tokens per manager block.
    :raises ValueError: the config uses an attention feature kvcore cannot serve exactly, or is a
        hybrid whose mixer states kvcore cannot own (``kvcore.hf.hybrid.REFUSED_HYBRIDS``).
    """
    check_servable(config)
    return layer_specs(config, dtype, block_size)


def layer_specs(config: Any, dtype: torch.dtype | str | None, block_size: int) -> dict[str, KVCacheSpec]:
    """:func:`specs_from_config` of a config that already passed :func:`check_servable`."""
    block_size = positive_int("block_size", block_size)
    value = dtype if dtype is not None else getattr(config, "dtype", None) or torch.float32
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    num_heads = positive_int("config.num_attention_heads", getattr(config, "num_attention_heads", None))
    kv_heads = positive_int("config.num_key_value_heads", getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = positive_int("head_dim", getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    full: KVCacheSpec = FullAttentionSpec(block_size, kv_heads, head_dim, value)
    specs: dict[str, KVCacheSpec] = {}
    if is_hybrid(config):
        state = mixer_spec(config, value, block_size)
        for attention, mixer in hybrid_layer_roles(config):
            if mixer is not None:
                specs[mixer] = state
            if attention is not None:
                specs[attention] = full
        return specs
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    for i, layer_type in enumerate(_layer_types(config)):
        if layer_type == "full_attention":
            spec = full
        elif layer_type == "sliding_attention" and window:
            window = positive_int("config.sliding_window", window)
            spec = SlidingWindowSpec(block_size, kv_heads, head_dim, value, sliding_window=window)
        elif layer_type == "chunked_attention" and chunk:
            chunk = positive_int("config.attention_chunk_size", chunk)
            spec = ChunkedLocalAttentionSpec(block_size, kv_heads, head_dim, value, attention_chunk_size=chunk)
        else:
            raise ValueError(
                f"layer {i} is {layer_type!r} but the config sets no "
                f"{'sliding_window' if layer_type == 'sliding_attention' else 'attention_chunk_size'}; "
                "set it or change config.layer_types"
            )
        specs[f"model.layers.{i}.self_attn"] = spec
    return specs
