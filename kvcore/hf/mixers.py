"""Run a hybrid model's mixers per request on their states in kvcore's state caches (transformers'
mixers cannot keep apart two requests of the engine's one packed row)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import transformers

try:
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # NOTE: transformers before its per-layer linear-attention caches (checked: 5.17, 5.23)
    LinearAttentionLayer = None

from kvcore.hf.scheduler import Request
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs.state import MambaSpec


@attrs.frozen(eq=False)
class MixerStep:
    """Where each request's tokens sit in this step's packed row, and its state slot per state group."""

    #: Columns of the single-token requests, and their slots per state group.
    decode_columns: torch.Tensor | None
    decode_slots: dict[int, torch.Tensor]
    #: Per multi-token request: first column, token count, slot per state group.
    prefills: list[tuple[int, int, dict[int, int]]]
    #: A warm-up pass: the whole row is one request on zero states outside the cache.
    scratch: bool = False


class _MixerLayer:
    """One mixer module, its kvcore state views, and the transformers ``Cache`` that hands them to it."""

    def __init__(self, module: torch.nn.Module, group_id: int, states: list[torch.Tensor]) -> None:
        self.module = module
        self.group_id = group_id
        # NOTE: Mamba2 and gated-delta-net specs hold (recurrent, conv); a short convolution's only (conv,).
        self.conv, self.recurrent = (states[1], states[0]) if len(states) == 2 else (states[0], None)
        params = inspect.signature(module.forward).parameters
        self.cache_kwarg = "cache_params" if "cache_params" in params else "past_key_values"
        self.layer = LinearAttentionLayer()
        # NOTE: always a previous state: a new sequence's slot was zeroed by begin_step, a fresh state.
        self.layer.has_previous_state[0] = True
        self.layer.is_conv_states_initialized[0] = True
        # NOTE: the Cache is indexed by the module's layer_idx; the layers before it are unused.
        unused = [LinearAttentionLayer() for _ in range(module.layer_idx)]
        self.cache = transformers.Cache(layers=unused + [self.layer])

    def _call(self, original: Any, x: torch.Tensor, pick: Any) -> tuple[torch.Tensor, ...]:
        """``original(x)`` on the states ``pick`` takes from the layer's; the output and those states."""
        conv = pick(self.conv)
        recurrent = None if self.recurrent is None else pick(self.recurrent)
        layer = self.layer
        layer.conv_states[0], layer.conv_kernel_size[0] = conv, conv.shape[-1]
        layer.device, layer.dtype = conv.device, conv.dtype
        layer.recurrent_states[0] = recurrent
        layer.is_recurrent_states_initialized[0] = recurrent is not None
        return original(x, **{self.cache_kwarg: self.cache}), conv, recurrent

    def run(self, step: MixerStep, hidden: torch.Tensor, original: Any) -> torch.Tensor:
        """Decodes in one ``[B, 1]`` call on states gathered from their slots, each prefill chunk in a
        ``[1, n]`` call on its slot."""
        if step.scratch:
            return self._call(original, hidden, lambda t: torch.zeros_like(t[:1]))[0]
        out = torch.empty_like(hidden)
        if step.decode_columns is not None:
            slots = step.decode_slots[self.group_id]
            x = hidden[0].index_select(0, step.decode_columns).unsqueeze(1)
            y, conv, recurrent = self._call(original, x, lambda t: t.index_select(0, slots))
            out[0].index_copy_(0, step.decode_columns, y[:, 0].to(out.dtype))
            self.conv.index_copy_(0, slots, conv)
            if recurrent is not None:
                self.recurrent.index_copy_(0, slots, recurrent)
        for start, n, slot_of in step.prefills:
            slot = slot_of[self.group_id]
            x = hidden[:, start : start + n]
            out[:, start : start + n] = self._call(original, x, lambda t: t[slot : slot + 1])[0]  # noqa: B023
        return out


class MixerRunner:
    """The mixer modules of one hybrid model, by path, bound to their state groups in ``kv``."""

    def __init__(self, kv: KVCache, modules: Mapping[str, torch.nn.Module]) -> None:
        if LinearAttentionLayer is None:
            raise ValueError(
                f"serving a hybrid model needs transformers' linear-attention cache layers, which "
                f"transformers {transformers.__version__} lacks; upgrade transformers (5.17 and later work)"
            )
        self.device = kv.device
        self.layers: dict[str, _MixerLayer] = {}
        for name, module in modules.items():
            g, group = kv.config.group_of(name)
            spec = group.kv_cache_spec
            if not isinstance(spec, MambaSpec):  # NOTE: kvcore's own invariant, not user input
                kind = type(spec).__name__
                raise RuntimeError(f"mixer {name} is in a {kind} group")  # noqa: TRY004
            states = spec.split_states(kv.layer_kv_caches[name])
            self.layers[name] = _MixerLayer(module, g, states)
        self.state_groups = sorted({layer.group_id for layer in self.layers.values()})
        self.step: MixerStep | None = None

    def plan(self, batch: list[tuple[Request, int]], tables: Sequence[np.ndarray]) -> MixerStep:
        """Columns and slots of this step's requests (``tables``: the scheduler's)."""
        decodes, prefills = [], []
        start = 0
        for request, n in batch:
            slots = {g: int(tables[g][request.row, 0]) for g in self.state_groups}
            if n == 1:
                decodes.append([start, *slots.values()])
            else:
                prefills.append((start, n, slots))
            start += n
        if not decodes:
            return MixerStep(None, {}, prefills)
        ids = torch.tensor(decodes, dtype=torch.long).T.contiguous().to(self.device)
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
            layer.module.forward = functools.partial(self._forward, layer, layer.module.forward)
        try:
            yield
        finally:
            for name, layer in self.layers.items():
                if saved[name] is None:
                    del layer.module.forward
                else:
                    layer.module.forward = saved[name]

    def _forward(self, layer: _MixerLayer, original: Any, hidden_states: torch.Tensor, *_: Any, **__: Any) -> Any:
        # NOTE: the decoder layer's mask and keyword arguments describe the packed row, which no
        # per-request call may see; each call gets only its own tokens and states.
        if self.step is None:
            raise RuntimeError("a kvcore-served mixer was called outside an engine step")
        return layer.run(self.step, hidden_states, original)
