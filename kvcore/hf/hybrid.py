"""Hybrid configs: which decoder layers hold a mixer and the state spec every mixer layer gets.

Each mixer layer gets one :class:`~kvcore.MambaSpec` holding the states transformers keeps for
it, in transformers' dtypes: Mamba2 (Bamba, GraniteMoeHybrid, FalconH1, NemotronH) and the gated
delta net (Qwen3-Next) keep a float32 recurrent state, then a convolution window in the model
dtype; LFM2's short convolution keeps only its window. Hybrids whose states kvcore cannot own
exactly are refused by name.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvcore.specs.state import MambaSpec
from kvcore._validate import positive_int


@attrs.frozen
class HybridFamily:
    """How one hybrid ``model_type`` names its modules and sizes its mixer states."""

    #: Attribute of a decoder layer holding its mixer.
    mixer: str
    #: Attribute of a decoder layer holding its attention module.
    attention: str
    #: ``"mamba2"``, ``"short_conv"`` or ``"gated_delta_net"``.
    kind: str
    #: Config attribute names: Mamba2's heads, head dim, groups, state size, conv kernel; a gated
    #: delta net's key heads, value heads, key head dim, value head dim, conv kernel.
    fields: tuple[str, ...] = ()


_BAMBA_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")

#: Hybrid ``model_type`` values kvcore serves (tokens equal ``model.generate`` in float32).
HYBRID_FAMILIES: dict[str, HybridFamily] = {
    "bamba": HybridFamily("mamba", "self_attn", "mamba2", _BAMBA_FIELDS),
    "granitemoehybrid": HybridFamily("mamba", "self_attn", "mamba2", _BAMBA_FIELDS),
    "falcon_h1": HybridFamily("mamba", "self_attn", "mamba2", _BAMBA_FIELDS),
    "nemotron_h": HybridFamily(
        "mixer", "mixer", "mamba2", ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
    ),
    "lfm2": HybridFamily("conv", "self_attn", "short_conv"),
    "qwen3_next": HybridFamily(
        "linear_attn", "self_attn", "gated_delta_net",
        ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
         "linear_conv_kernel_dim"),
    ),
}

_SHARED_ATTENTION = "its decoder layers share one attention module, whose KV cache kvcore cannot page per layer"

#: Hybrid ``model_type`` values kvcore refuses: (architecture name, why).
REFUSED_HYBRIDS: dict[str, tuple[str, str]] = {
    "jamba": ("Jamba", "its torch Mamba scan always starts from a zero state, so a prompt cannot be prefilled "
                       "in chunks"),
    "minimax": ("MiniMax", "it keeps its linear-attention states in its own cache class, which kvcore cannot own"),
    "zamba": ("Zamba", _SHARED_ATTENTION),
    "zamba2": ("Zamba2", _SHARED_ATTENTION),
}

#: ``layer_types`` entry -> (attention?, mixer?): FalconH1's "hybrid" layers hold both, NemotronH's
#: MLP / MoE layers neither.
_LAYER_ROLES = {
    **dict.fromkeys(("linear_attention", "conv", "mamba"), (False, True)),
    "hybrid": (True, True),
    **dict.fromkeys(("mlp", "moe"), (False, False)),
    **dict.fromkeys(("full_attention", "attention"), (True, False)),
}


def refuse_unservable_hybrid(config: Any) -> None:
    """``ValueError`` naming the architecture when ``config`` is a hybrid kvcore refuses."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_HYBRIDS:
        name, why = REFUSED_HYBRIDS[model_type]
        raise ValueError(
            f"kvcore does not serve {name} hybrids (model_type {model_type!r}): {why}. Served hybrids: "
            f"{sorted(HYBRID_FAMILIES)}"
        )


def is_hybrid(config: Any) -> bool:
    return getattr(config, "model_type", None) in HYBRID_FAMILIES


def _mixer_intermediate(config: Any, model_type: str, heads: int, head_dim: int) -> int:
    if model_type == "nemotron_h":
        return heads * head_dim
    d_ssm = getattr(config, "mamba_d_ssm", None) if model_type == "falcon_h1" else None
    if d_ssm is not None:
        return positive_int("config.mamba_d_ssm", d_ssm)
    return int(config.mamba_expand * config.hidden_size)


def mixer_spec(config: Any, dtype: torch.dtype, block_size: int) -> MambaSpec:
    """The state spec every mixer layer of hybrid ``config`` shares."""
    model_type = config.model_type
    family = HYBRID_FAMILIES[model_type]
    if family.kind == "short_conv":
        hidden = positive_int("config.hidden_size", config.hidden_size)
        window = positive_int("config.conv_L_cache", config.conv_L_cache)
        return MambaSpec(block_size, [(hidden, window)], [dtype])
    sizes = [positive_int(f"config.{name}", getattr(config, name, None)) for name in family.fields]
    # NOTE: the scans return their final state in float32 and transformers keeps it so (bf16 models too).
    recurrent_dtype = torch.float32 if dtype.itemsize <= 4 else dtype
    if family.kind == "gated_delta_net":
        k_heads, v_heads, k_dim, v_dim, kernel = sizes
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        return MambaSpec(block_size, [(v_heads, k_dim, v_dim), (conv_dim, kernel)], [recurrent_dtype, dtype])
    heads, head_dim, groups, d_state, kernel = sizes
    conv_dim = _mixer_intermediate(config, model_type, heads, head_dim) + 2 * groups * d_state
    return MambaSpec(block_size, [(heads, head_dim, d_state), (conv_dim, kernel)], [recurrent_dtype, dtype])


def hybrid_layer_roles(config: Any) -> list[tuple[str | None, str | None]]:
    """Per decoder layer of hybrid ``config``: ``(attention module path, mixer module path)``, None where absent."""
    family = HYBRID_FAMILIES[config.model_type]
    num_layers = positive_int("config.num_hidden_layers", getattr(config, "num_hidden_layers", None))
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if types is None or len(types) != num_layers:
        raise ValueError(
            f"this {config.model_type} config lists {None if types is None else len(types)} layer types for "
            f"{num_layers} layers; give config.layer_types one entry per layer"
        )
    roles: list[tuple[str | None, str | None]] = []
    for i, layer_type in enumerate(types):
        if layer_type not in _LAYER_ROLES:
            raise ValueError(
                f"layer {i} of this {config.model_type} config is {layer_type!r}, a layer type kvcore does not "
                "know; kvcore serves attention, mixer and MLP layers"
            )
        attention, mixer = _LAYER_ROLES[layer_type]
        roles.append((f"model.layers.{i}.{family.attention}" if attention else None,
                      f"model.layers.{i}.{family.mixer}" if mixer else None))
    return roles


def check_hybrid_options(
    config: Any, num_attention: int, prefix_caching: bool, tp_size: int, cuda_graphs: bool | None
) -> None:
    """Refuse what a hybrid model cannot be served with."""
    kind = config.model_type
    if num_attention == 0:
        raise ValueError(
            f"this {kind!r} config has mixer layers only; kvcore.hf serves hybrids with at least one "
            "attention layer (set the config's layer types)"
        )
    if prefix_caching:
        raise ValueError(
            f"prefix caching cannot serve the hybrid {kind!r}: its mixer states are kept per sequence, not per "
            "block, so no cached block names the state after a prefix; pass enable_prefix_caching=False"
        )
    if tp_size > 1:
        raise ValueError(f"kvcore.hf serves the hybrid {kind!r} on one device only; its mixer states are not sharded")
    if cuda_graphs:
        raise ValueError(
            f"CUDA graphs cannot capture the hybrid {kind!r}: its mixers run per request with shapes that "
            "change every step; pass cuda_graphs=False (or None)"
        )
