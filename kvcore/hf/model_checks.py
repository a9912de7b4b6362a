"""What the engine checks on a transformers model before serving it, and reads from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcore.hf.specs import SERVED_MODEL_TYPES, check_servable

#: KV cache memory when neither ``num_blocks`` nor ``available_memory`` is given, on a CPU.
CPU_DEFAULT_MEMORY = 256 << 20
#: Fraction of the free device memory the cache takes by default on a GPU.
GPU_MEMORY_FRACTION = 0.9


def check_model(model: Any) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise TypeError(f"model must be a transformers causal LM (a torch.nn.Module with a config), got {model!r}")
    check_servable(config)
    if model_type not in SERVED_MODEL_TYPES:
        raise ValueError(
            f"kvcore.hf serves the model types {list(SERVED_MODEL_TYPES)}; {type(model).__name__} is "
            f"{model_type!r}, whose modeling code kvcore has not verified token for token"
        )


def attention_modules(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.nn.Module]:
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"{type(model).__name__} has no attention modules {missing[:2]}...; pass the "
            "*ForCausalLM model (its decoder layers are model.layers.<i>)"
        )
    for name in names:
        if getattr(modules[name], "sinks", None) is not None:
            raise ValueError(f"{name} has attention sinks, which no kvcore backend implements")
    return {n: modules[n] for n in names}


def default_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * GPU_MEMORY_FRACTION)
    return CPU_DEFAULT_MEMORY


def eos_ids(model: Any) -> frozenset[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def check_hybrid_options(
    config: Any, num_attention: int, prefix_caching: bool, tp_size: int, cuda_graphs: bool | None
) -> bool:
    """Refuse what a hybrid model cannot be served with; returns ``cuda_graphs`` resolved (off)."""
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
    return False
