"""KV cache specs of a transformers decoder config (attention specs, a hybrid's mixers'
``MambaSpec``), and the ``ValueError`` naming what kvcore cannot serve exactly."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvcore._validate import positive_int
from kvcore.specs.attention import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from kvcore.specs.base import KVCacheSpec
from kvcore.specs.state import MambaSpec


class HybridFamily(NamedTuple):
    """How one hybrid ``model_type`` names its decoder layers' modules and sizes its mixer states."""

    mixer: str
    attention: str
    #: ``"mamba2"``, ``"short_conv"`` or ``"gated_delta_net"``.
    kind: str
    #: Config attributes: Mamba2's heads, head dim, groups, state size, conv kernel; a gated delta
    #: net's key heads, value heads, key head dim, value head dim, conv kernel; a short convolution's
    #: channels and window.
    fields: tuple[str, ...]


_BAMBA = HybridFamily(
    "mamba", "self_attn", "mamba2", ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")
)
#: Hybrid ``model_type`` values kvcore serves (tokens equal ``model.generate`` in float32).
HYBRID_FAMILIES = {
    "bamba": _BAMBA,
    "granitemoehybrid": _BAMBA,
    "falcon_h1": _BAMBA,
    "nemotron_h": HybridFamily(
        "mixer", "mixer", "mamba2", ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
    ),
    "lfm2": HybridFamily("conv", "self_attn", "short_conv", ("hidden_size", "conv_L_cache")),
    "qwen3_next": HybridFamily(
        "linear_attn", "self_attn", "gated_delta_net",
        ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
         "linear_conv_kernel_dim"),
    ),
}

_SHARED_ATTENTION = "its decoder layers share one attention module, whose KV cache kvcore cannot page per layer"
#: Hybrid ``model_type`` values kvcore refuses: (architecture name, why).
REFUSED_HYBRIDS = {
    "jamba": ("Jamba", "its torch Mamba scan always starts from a zero state, so a prompt cannot be prefilled "
                       "in chunks"),
    "minimax": ("MiniMax", "it keeps its linear-attention states in its own cache class, which kvcore cannot own"),
    "zamba": ("Zamba", _SHARED_ATTENTION),
    "zamba2": ("Zamba2", _SHARED_ATTENTION),
}

#: ``model_type`` values whose transformers modeling code the engine serves (tested for exactness).
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", *HYBRID_FAMILIES)

_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: A hybrid's ``layer_types`` entry -> (attention?, mixer?): FalconH1's "hybrid" layers hold both,
#: NemotronH's MLP / MoE layers neither.
_LAYER_ROLES = {
    **dict.fromkeys(("linear_attention", "conv", "mamba"), (False, True)),
    "hybrid": (True, True),
    **dict.fromkeys(("mlp", "moe"), (False, False)),
    **dict.fromkeys(("full_attention", "attention"), (True, False)),
}


def is_hybrid(config: Any) -> bool:
    return getattr(config, "model_type", None) in HYBRID_FAMILIES


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
    """Raise ``ValueError`` naming what of ``config`` kvcore cannot serve exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_HYBRIDS:
        name, why = REFUSED_HYBRIDS[model_type]
        raise ValueError(
            f"kvcore does not serve {name} hybrids (model_type {model_type!r}): {why}. Served hybrids: "
            f"{sorted(HYBRID_FAMILIES)}"
        )
    found = unsupported_features(config)
    if found:
        raise ValueError(
            f"kvcore cannot serve this {model_type or type(config).__name__} config exactly: it uses "
            f"{'; '.join(found)}. No kvcore backend implements that; use a model without it"
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
    types = [] if is_hybrid(config) else _layer_types(config)
    if "chunked_attention" in types:
        raise ValueError(
            f"model.layers.{types.index('chunked_attention')}.self_attn uses chunked local attention, which no "
            "kvcore backend implements"
        )


def check_hybrid_options(
    config: Any, num_attention: int, prefix_caching: bool, tp_size: int, cuda_graphs: bool | None,
    separate_state_pages: bool,
) -> None:
    """Refuse what a hybrid model cannot be served with."""
    kind = config.model_type
    if num_attention == 0:
        raise ValueError(
            f"this {kind!r} config has mixer layers only; kvcore.hf serves hybrids with at least one "
            "attention layer (set the config's layer types)"
        )
    if prefix_caching and not separate_state_pages:
        raise ValueError(
            f"prefix caching serves the hybrid {kind!r} only with separate_state_pages (None or True), whose "
            "state region keeps its checkpoints; pass enable_prefix_caching=False or separate_state_pages=None"
        )
    if tp_size > 1:
        raise ValueError(f"kvcore.hf serves the hybrid {kind!r} on one device only; its mixer states are not sharded")
    if cuda_graphs and not separate_state_pages:
        raise ValueError(
            f"CUDA graphs serve the hybrid {kind!r} only with separate_state_pages (None or True): padded "
            "decode rows then update a state slot that nothing reads; pass cuda_graphs=False or None"
        )


def check_checkpoint_tokens(tokens: Any, block_size: int) -> int:
    """``state_checkpoint_tokens``: a positive multiple of the attention block size."""
    tokens = positive_int("state_checkpoint_tokens", tokens)
    if tokens % block_size:
        raise ValueError(
            f"state_checkpoint_tokens={tokens} is not a multiple of the {block_size}-token attention block, so "
            f"no cached prefix would end at a checkpoint; pass a multiple of {block_size} (or None for {block_size})"
        )
    return tokens


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
    if is_hybrid(config):
        types = types or getattr(config, "layers_block_type", None)
    elif types is None:
        chunk, window = getattr(config, "attention_chunk_size", None), getattr(config, "sliding_window", None)
        types = ["chunked_attention" if chunk else "sliding_attention" if window else "full_attention"] * num_layers
    if types is None or len(types) != num_layers:
        raise ValueError(
            f"config.layer_types lists {None if types is None else len(types)} layers but num_hidden_layers="
            f"{num_layers}; give one type per layer"
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
        hybrid whose mixer states kvcore cannot own (``REFUSED_HYBRIDS``).
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
        family, state = HYBRID_FAMILIES[config.model_type], _mixer_spec(config, value, block_size)
        for i, layer_type in enumerate(_layer_types(config)):
            if layer_type not in _LAYER_ROLES:
                raise ValueError(
                    f"layer {i} of this {config.model_type} config is {layer_type!r}, a layer type kvcore does "
                    "not know; kvcore serves attention, mixer and MLP layers"
                )
            attention, mixer = _LAYER_ROLES[layer_type]
            if mixer:
                specs[f"model.layers.{i}.{family.mixer}"] = state
            if attention:
                specs[f"model.layers.{i}.{family.attention}"] = full
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


def _mixer_spec(config: Any, dtype: torch.dtype, block_size: int) -> MambaSpec:
    """The state spec every mixer layer of hybrid ``config`` shares."""
    model_type = config.model_type
    family = HYBRID_FAMILIES[model_type]
    sizes = [positive_int(f"config.{name}", getattr(config, name, None)) for name in family.fields]
    if family.kind == "short_conv":
        return MambaSpec(block_size, [tuple(sizes)], [dtype], mamba_type=family.kind)
    # NOTE: the scans return their final state in float32 and transformers keeps it so (bf16 models too).
    recurrent_dtype = torch.float32 if dtype.itemsize <= 4 else dtype
    if family.kind == "gated_delta_net":
        k_heads, v_heads, k_dim, v_dim, kernel = sizes
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        shapes = [(v_heads, k_dim, v_dim), (conv_dim, kernel)]
        return MambaSpec(block_size, shapes, [recurrent_dtype, dtype], mamba_type=family.kind)
    heads, head_dim, groups, d_state, kernel = sizes
    if model_type == "nemotron_h":
        intermediate = heads * head_dim
    elif model_type == "falcon_h1" and getattr(config, "mamba_d_ssm", None) is not None:
        intermediate = positive_int("config.mamba_d_ssm", config.mamba_d_ssm)
    else:
        intermediate = int(config.mamba_expand * config.hidden_size)
    conv_dim = intermediate + 2 * groups * d_state
    shapes = [(heads, head_dim, d_state), (conv_dim, kernel)]
    return MambaSpec(block_size, shapes, [recurrent_dtype, dtype], mamba_type=family.kind)
