"""The reference mixer backend: every mixer kvcore serves, run by transformers' own modules on
states gathered from their slots and scattered back (exact, not fast)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvcore.plugins.mixer_backend import MixerBackend


class _ModuleCache:
    """A transformers ``Cache`` whose one linear-attention layer hands a mixer module the states
    given to :meth:`run` (the module reads and writes them in place)."""

    def __init__(self, module: torch.nn.Module) -> None:
        try:
            import transformers
            from transformers.cache_utils import LinearAttentionLayer
        except ImportError as exc:  # NOTE: transformers before its per-layer linear-attention caches
            raise ValueError(
                "the torch-mixer backend runs transformers' mixer modules and needs transformers 5.17 or "
                f"later with its linear-attention cache layers ({exc}); upgrade transformers"
            ) from exc
        params = inspect.signature(type(module).forward).parameters
        self.kwarg = "cache_params" if "cache_params" in params else "past_key_values"
        self.layer = LinearAttentionLayer()
        # NOTE: always a previous state: a new sequence's slot was zeroed, a fresh state.
        self.layer.has_previous_state[0] = True
        self.layer.is_conv_states_initialized[0] = True
        # NOTE: the Cache is indexed by the module's layer_idx; the layers before it are unused.
        unused = [LinearAttentionLayer() for _ in range(module.layer_idx)]
        self.cache = transformers.Cache(layers=[*unused, self.layer])

    def run(self, module: torch.nn.Module, x: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """``module``'s own forward of ``x`` ``[B, n, hidden]`` on ``states`` (batch ``B``)."""
        # NOTE: kvcore's Mamba2 and gated-delta-net specs hold (recurrent, conv); a short
        # convolution's only (conv,).
        conv, recurrent = (states[1], states[0]) if len(states) == 2 else (states[0], None)
        layer = self.layer
        layer.conv_states[0], layer.conv_kernel_size[0] = conv, conv.shape[-1]
        layer.device, layer.dtype = conv.device, conv.dtype
        layer.recurrent_states[0] = recurrent
        layer.is_recurrent_states_initialized[0] = recurrent is not None
        # NOTE: the class's forward: the engine routes calls of the module itself to its backend.
        return type(module).forward(module, x, **{self.kwarg: self.cache})


_CACHES: weakref.WeakKeyDictionary[torch.nn.Module, _ModuleCache] = weakref.WeakKeyDictionary()


def _cache_of(module: torch.nn.Module) -> _ModuleCache:
    found = _CACHES.get(module)
    if found is None:
        found = _CACHES[module] = _ModuleCache(module)
    return found


class TorchMixerBackend(MixerBackend):
    """Reference mixers: decodes gather the batch's states by slot, run the module once on
    ``[T, 1, hidden]`` and scatter the states back; a prefill chunk runs on its slot in place,
    equal-length chunks of several sequences in one gathered call."""

    name: ClassVar[str] = "torch-mixer"
    mamba_types: ClassVar[tuple[str, ...]] = ("mamba2", "short_conv", "gated_delta_net")

    @staticmethod
    def decode(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
               slot_ids: torch.Tensor) -> torch.Tensor:
        index = slot_ids.long()
        gathered = [state.index_select(0, index) for state in states]
        out = _cache_of(layer).run(layer, hidden_states.unsqueeze(1), gathered)
        for state, new in zip(states, gathered):
            state.index_copy_(0, index, new)
        return out[:, 0]

    @staticmethod
    def prefill(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                slot_id: int) -> torch.Tensor:
        views = [state[slot_id : slot_id + 1] for state in states]
        return _cache_of(layer).run(layer, hidden_states.unsqueeze(0), views)[0]

    @staticmethod
    def prefill_batch(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                      slot_ids: Sequence[int]) -> torch.Tensor:
        # NOTE: the modules keep the rows of a batch apart; one call for the equal-length chunks.
        index = torch.tensor(list(slot_ids), dtype=torch.long).to(states[0].device, non_blocking=True)
        gathered = [state.index_select(0, index) for state in states]
        out = _cache_of(layer).run(layer, hidden_states, gathered)
        for state, new in zip(states, gathered):
            state.index_copy_(0, index, new)
        return out
