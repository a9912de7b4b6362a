"""The attention function kvcore registers with transformers' ``AttentionInterface``: it sends each
layer's call on a step's packed row to that layer's backend ``forward``, with no mask."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from transformers import AttentionInterface

from kvcore.errors import PluginError

#: The ``attn_implementation`` name of kvcore's attention function.
ATTENTION_NAME = "kvcore"
#: The ``model(...)`` keyword that carries a step's :class:`StepContext`.
STEP_KWARG = "kvcore_step"


@attrs.frozen(eq=False)
class LayerBinding:
    """What one attention module needs: its backend, cache view, head size and its group's window."""

    name: str
    backend: Any = attrs.field(repr=False)
    kv_cache: torch.Tensor = attrs.field(repr=False)
    head_size: int
    sliding_window: int | None


@attrs.frozen(eq=False)
class StepContext:
    """One step's view of the cache: layer bindings by module and metadata by layer name."""

    layers: Mapping[torch.nn.Module, LayerBinding] = attrs.field(repr=False)
    metadata: Mapping[str, Any] = attrs.field(repr=False)


def kvcore_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    sliding_window: int | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Paged attention of one layer for a packed step; returns ``([1, tokens, heads, head_dim_v], None)``."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepContext):
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention implementation only runs inside kvcore.hf.Engine, "
                           "which passes each step's KV cache context; call model.set_attn_implementation('sdpa') "
                           "to run the model on its own")
    layer = step.layers.get(module)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} is not an attention module the engine bound to the KV cache")
    if query.shape[0] != 1:
        raise RuntimeError(f"kvcore attention takes one packed row of tokens, got a batch of {query.shape[0]}")
    scale = module.scaling if scaling is None else scaling
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    result = layer.backend.forward(  # NOTE: the output is what forward returns (``out``, written)
        q, k, v, layer.kv_cache, step.metadata[layer.name],
        head_size=layer.head_size, scale=scale, sliding_window=layer.sliding_window, out=out,
    )
    if not isinstance(result, torch.Tensor) or result.shape != out.shape:
        raise PluginError(f"backend {layer.backend.get_name()!r} forward returned {getattr(result, 'shape', result)!r}"
                          f" for {layer.name}; forward returns the output, {tuple(out.shape)}, in out if given")
    return result.unsqueeze(0), None


def register_attention() -> None:
    """Register :func:`kvcore_attention` as ``attn_implementation="kvcore"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvcore_attention)
