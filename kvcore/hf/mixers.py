"""Run a hybrid model's mixers per request on their states in kvcore's state caches.

Attention keeps the engine's single packed row of tokens, but transformers'
mixers (Mamba2, short convolution) cannot keep two requests in one row apart.
While the engine serves, each mixer module's ``forward`` is replaced on the
instance (the class and transformers stay untouched) by one that splits the
packed row:

- all single-token requests (decodes) go in one ``[B, 1]`` call on states
  gathered from their slots and scattered back afterwards;
- each multi-token prefill chunk goes in its own ``[1, n]`` call on views of
  its slot, which transformers updates in place.

The mixer reads and writes its states through a real transformers ``Cache``
whose one linear-attention layer holds kvcore tensors and always has a
previous state: a new sequence's slot was zeroed by ``KVCache.begin_step``,
which is what a fresh state is, so chunked prefill simply continues from the
slot.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from transformers import Cache

try:
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # NOTE: transformers before its per-layer linear-attention caches (checked: 5.17, 5.23)
    LinearAttentionLayer = None

from kvcore.runtime.kv_cache import KVCache
from kvcore.specs.state import MambaSpec
from kvcore.hf.requests import Request


@attrs.frozen(eq=False)
class MixerStep:
    """Where each request's tokens sit in this step's packed row, and its state slot per state group."""

    #: Columns of the single-token requests, and their slots per state group ``[groups][B]``.
    decode_columns: torch.Tensor | None
    decode_slots: dict[int, torch.Tensor]
    #: Per multi-token request: first column, token count, slot per state group.
    prefills: list[tuple[int, int, dict[int, int]]]
    #: A warm-up pass: the whole row is one request on zero states outside the cache.
    scratch: bool = False


class _SlotCache:
    """A transformers ``Cache`` whose layer ``layer_idx`` holds the states it is pointed at."""

    def __init__(self, layer_idx: int) -> None:
        self.layer = LinearAttentionLayer()
        self.layer.has_previous_state[0] = True
        self.layer.is_conv_states_initialized[0] = True
        self.cache = Cache(layers=[LinearAttentionLayer() for _ in range(layer_idx)] + [self.layer])

    def point(self, conv: torch.Tensor, recurrent: torch.Tensor | None) -> Cache:
        layer = self.layer
        layer.conv_states[0] = conv
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.device, layer.dtype = conv.device, conv.dtype
        layer.recurrent_states[0] = recurrent
        layer.is_recurrent_states_initialized[0] = recurrent is not None
        return self.cache


class _MixerLayer:
    """One mixer module, its kvcore state views and the keyword its ``forward`` takes the cache by."""

    def __init__(self, module: torch.nn.Module, group_id: int, states: list[torch.Tensor]) -> None:
        self.module = module
        self.group_id = group_id
        self.point_at(states)
        params = inspect.signature(module.forward).parameters
        self.cache_kwarg = "cache_params" if "cache_params" in params else "past_key_values"
        self.slot_cache = _SlotCache(module.layer_idx)

    def point_at(self, states: list[torch.Tensor]) -> None:
        """Read and write ``states`` (``MambaSpec.split_states`` of the layer's cache view) from now on."""
        # NOTE: Mamba2 and gated-delta-net specs hold (recurrent, conv); a short convolution's only (conv,).
        self.conv, self.recurrent = (states[1], states[0]) if len(states) == 2 else (states[0], None)

    def run(self, step: MixerStep, hidden: torch.Tensor, original: Any) -> torch.Tensor:
        if step.scratch:
            conv = torch.zeros_like(self.conv[:1])
            recurrent = None if self.recurrent is None else torch.zeros_like(self.recurrent[:1])
            return original(hidden, **{self.cache_kwarg: self.slot_cache.point(conv, recurrent)})
        out = torch.empty_like(hidden)
        g = self.group_id
        if step.decode_columns is not None:
            slots = step.decode_slots[g]
            conv = self.conv.index_select(0, slots)
            recurrent = None if self.recurrent is None else self.recurrent.index_select(0, slots)
            x = hidden[0].index_select(0, step.decode_columns).unsqueeze(1)
            y = original(x, **{self.cache_kwarg: self.slot_cache.point(conv, recurrent)})
            out[0].index_copy_(0, step.decode_columns, y[:, 0].to(out.dtype))
            self.conv.index_copy_(0, slots, conv)
            if recurrent is not None:
                self.recurrent.index_copy_(0, slots, recurrent)
        for start, n, slot_of in step.prefills:
            slot = slot_of[g]
            conv = self.conv[slot : slot + 1]
            recurrent = None if self.recurrent is None else self.recurrent[slot : slot + 1]
            y = original(hidden[:, start : start + n], **{self.cache_kwarg: self.slot_cache.point(conv, recurrent)})
            out[:, start : start + n] = y
        return out


class MixerRunner:
    """The mixers of one hybrid model bound to their state groups in ``kv``."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, mixer_names: Sequence[str]) -> None:
        if LinearAttentionLayer is None:
            import transformers

            raise ValueError(
                f"serving a hybrid model needs transformers' linear-attention cache layers, which "
                f"transformers {transformers.__version__} lacks; upgrade transformers (5.17 and later work)"
            )
        modules = dict(model.named_modules())
        group_of = {name: g for g, group in enumerate(kv.config.kv_cache_groups) for name in group.layer_names}
        self.device = kv.device
        self.state_groups = sorted({group_of[name] for name in mixer_names})
        self.layers = {
            name: _MixerLayer(modules[name], group_of[name], self._states(kv, name)) for name in mixer_names
        }
        self.step: MixerStep | None = None

    @staticmethod
    def _states(kv: KVCache, name: str) -> list[torch.Tensor]:
        spec = kv.config.group_of(name)[1].kv_cache_spec
        if not isinstance(spec, MambaSpec):
            raise RuntimeError(f"{name} is a mixer but its KV cache group holds {type(spec).__name__}")
        return spec.split_states(kv.layer_kv_caches[name])

    def rebind(self, kv: KVCache) -> None:
        """Point every mixer at ``kv``'s current views (after the cache's tensors were reallocated)."""
        for name, layer in self.layers.items():
            layer.point_at(self._states(kv, name))

    def plan(self, batch: list[tuple[Request, int]], tables: Sequence[np.ndarray]) -> MixerStep:
        """Columns and slots of this step's requests (``batch`` in packed order; ``tables``: the scheduler's)."""
        columns, decode_slots, prefills = [], {g: [] for g in self.state_groups}, []
        start = 0
        for request, n in batch:
            slots = {g: int(tables[g][request.row, 0]) for g in self.state_groups}
            if n == 1:
                columns.append(start)
                for g in self.state_groups:
                    decode_slots[g].append(slots[g])
            else:
                prefills.append((start, n, slots))
            start += n
        if not columns:
            return MixerStep(None, {}, prefills)
        host = torch.tensor([columns] + [decode_slots[g] for g in self.state_groups], dtype=torch.long)
        ids = host.to(self.device)
        return MixerStep(ids[0], {g: ids[i + 1] for i, g in enumerate(self.state_groups)}, prefills)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        """Run the mixers on zero states outside the cache for the duration (a warm-up pass)."""
        self.step = MixerStep(None, {}, [], scratch=True)
        try:
            yield
        finally:
            self.step = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route every mixer module's calls through :meth:`_MixerLayer.run` for the duration."""
        saved = {name: vars(layer.module).get("forward") for name, layer in self.layers.items()}
        for layer in self.layers.values():
            layer.module.forward = self._forward_of(layer, layer.module.forward)
        try:
            yield
        finally:
            for name, layer in self.layers.items():
                if saved[name] is None:
                    del layer.module.forward
                else:
                    layer.module.forward = saved[name]

    def _forward_of(self, layer: _MixerLayer, original: Any) -> Any:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # NOTE: the decoder layer's mask and keyword arguments describe the packed row, which
            # no per-request call may see; each call gets only its own tokens and states.
            if self.step is None:
                raise RuntimeError("a kvcore-served mixer was called outside an engine step")
            return layer.run(self.step, hidden_states, original)

        return forward
