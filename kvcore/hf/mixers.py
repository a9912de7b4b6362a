"""A hybrid model's mixer layers, run through their mixer backends on the states in kvcore's state
caches: per step one ``decode`` call per layer for every decoding sequence, one ``prefill`` call
per prefill chunk (transformers' mixers cannot keep apart two requests of one packed row)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvcore.hf.scheduler import Request
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.plugins.mixer_backend import batches_varlen, copy_slots, prefill_equal
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs.state import MambaSpec


def is_decode(request: Request | None, num_tokens: int) -> bool:
    """Whether a scheduled entry runs in the step's one decode call (a token, and no checkpoint)."""
    return num_tokens == 1 and not (request is not None and request.checkpoints)


@attrs.frozen(eq=False)
class MixerStep:
    """One step's mixer work: the first ``num_decodes`` columns of the packed row decode (their
    state slots per state group, on the device); then each prefill chunk (first column, tokens,
    slot per state group, and the checkpoints it passes: tokens into the chunk, block per group)."""

    num_decodes: int
    decode_slots: dict[int, torch.Tensor]
    prefills: list[tuple[int, int, dict[int, int], list[tuple[int, dict[int, int]]]]]
    #: A warm-up pass on zero states outside the cache: the whole row is one sequence's chunk, or
    #: (``num_decodes``) single tokens of as many sequences.
    scratch: bool = False
    #: The index tensors of the step's calls with chunks of different lengths, made by the first
    #: mixer layer and shared by the others.
    gathers: dict = attrs.field(factory=dict)


class MixerLayer:
    """One mixer module, its backend, its state views in the cache, and the most chunk-padded tokens
    one prefill call may take (``max_tokens`` rounded up to the module's ``chunk_size``, if any, and
    one chunk more where the backend batches chunks of different lengths)."""

    def __init__(self, module: torch.nn.Module, group_id: int, states: list[torch.Tensor], backend: Any,
                 max_tokens: int) -> None:
        self.module, self.group_id, self.states, self.backend = module, group_id, states, backend
        chunk = getattr(module, "chunk_size", None)
        self.chunk = chunk if isinstance(chunk, int) and chunk > 0 else 1
        self.varlen = self.chunk > 1 and batches_varlen(backend)
        # NOTE: when chunks of different lengths share a call, a sequence's remainder from the previous
        # step may add one padded row beyond the budget's (the engine measures its step with it)
        self.max_padded = -(-max_tokens // self.chunk) * self.chunk + (self.chunk if self.varlen else 0)

    def run(self, step: MixerStep, hidden: torch.Tensor) -> torch.Tensor:
        """The mixer's output for the packed row ``hidden`` ``[1, tokens, hidden]``."""
        module, backend, row = self.module, self.backend, hidden[0]
        if step.scratch:
            scratch = [torch.zeros_like(state[:1]) for state in self.states]
            if step.num_decodes:
                slots = torch.zeros(step.num_decodes, dtype=torch.int32, device=row.device)
                return backend.decode(module, row, scratch, slots).unsqueeze(0)
            return backend.prefill(module, row, scratch, 0).unsqueeze(0)
        decodes = step.num_decodes
        if decodes:
            y = backend.decode(module, row[:decodes], self.states, step.decode_slots[self.group_id])
            if not step.prefills:
                return y.unsqueeze(0)
        out = torch.empty_like(hidden)
        if decodes:
            out[0, :decodes] = y
        g, chunks = self.group_id, {}
        for start, n, slots, cuts in step.prefills:
            padded = -(-n // self.chunk) * self.chunk
            # NOTE: chunks of one length (and with checkpoints or not) batch; with a backend that scans
            # past a row's end, chunks of one padded length batch too, checkpoints and all
            key = (padded,) if self.varlen and n > 1 else (padded, n, bool(cuts))
            chunks.setdefault(key, []).append((start, n, slots[g], [(cut, blocks[g]) for cut, blocks in cuts]))
        for key, found in chunks.items():
            # NOTE: a module that pads its chunk scan pads every row: rows capped so that one call's
            # activations stay within those of the step budget in one row (what the engine measured)
            rows = max(1, self.max_padded // key[0])
            for part in (found[at : at + rows] for at in range(0, len(found), rows)):
                if len({n for _, n, _, _ in part}) > 1:
                    self._prefill_varlen(part, row, out, step.gathers)
                else:
                    self._prefill(part, row, out)
        return out

    def _prefill(self, part: list[tuple[int, int, int, list]], row: torch.Tensor, out: torch.Tensor) -> None:
        """Equal-length chunks ``(start, tokens, slot, checkpoints)`` of the packed ``row``, into ``out``."""
        slots, first, n = [slot for _, _, slot, _ in part], part[0][0], part[0][1]
        # NOTE: chunks that lie back to back in the packed row are a view of it, in and out
        adjacent = all(start == first + i * n for i, (start, _, _, _) in enumerate(part))
        xs = (row[first : first + len(part) * n].view(len(part), n, -1) if adjacent
              else torch.stack([row[a : a + n] for a, _, _, _ in part]))
        # NOTE: checkpoints the chunks pass are written to their state blocks
        ys = prefill_equal(self.backend, self.module, xs, self.states, slots, [cuts for *_, cuts in part])
        if adjacent:
            out[0, first : first + len(part) * n] = ys.reshape(len(part) * n, -1)
            return
        for (start, _, _, _), y in zip(part, ys):
            out[0, start : start + n] = y

    def _prefill_varlen(self, part: list[tuple[int, int, int, list]], row: torch.Tensor, out: torch.Tensor,
                        gathers: dict) -> None:
        """Chunks of different lengths in one call: gathered from ``row`` right-padded (a padding
        position repeats its row's last token), their tokens' outputs scattered back into ``out``
        (the index tensors made once per step, in ``gathers``)."""
        key = tuple((start, n) for start, n, _, _ in part)
        if key not in gathers:
            starts, lengths = (np.array(column, dtype=np.int64) for column in zip(*key))
            longest, steps = int(lengths.max()), np.arange(int(lengths.max()))
            gather = starts[:, None] + np.minimum(steps, lengths[:, None] - 1)
            real = steps < lengths[:, None]
            kept = (np.arange(len(part))[:, None] * longest + steps).reshape(-1)[real.reshape(-1)]
            index = torch.from_numpy(np.concatenate([gather.reshape(-1), kept, gather[real]]))
            index = index.to(row.device, non_blocking=True).split([gather.size, len(kept), len(kept)])
            # NOTE: chunks back to back in the row come back in one slice
            adjacent = np.array_equal(starts, starts[0] + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
            gathers[key] = (*index, longest, lengths.tolist(), adjacent)
        picked, sources, targets, longest, lengths, adjacent = gathers[key]
        xs = row.index_select(0, picked).view(len(part), longest, -1)
        # NOTE: checkpoints passed only when some row keeps one
        cuts = [cuts for *_, cuts in part]
        ys = self.backend.prefill_varlen(self.module, xs, self.states, [slot for _, _, slot, _ in part], lengths,
                                         *([cuts] if any(cuts) else []))
        ys = ys.reshape(-1, ys.shape[-1]).index_select(0, sources)
        if adjacent:
            out[0, key[0][0] : key[0][0] + len(sources)] = ys
        else:
            out[0].index_copy_(0, targets, ys)


class MixerRunner:
    """The mixer modules of one hybrid model, by path, bound to their state groups and backends
    (``max_tokens``: the engine's step budget, which bounds one prefill call)."""

    def __init__(self, kv: KVCache, modules: Mapping[str, torch.nn.Module], max_tokens: int) -> None:
        self.layers: dict[str, MixerLayer] = {}
        for name, module in modules.items():
            g, group = kv.config.group_of(name)
            spec = group.kv_cache_spec
            if not isinstance(spec, MambaSpec):  # NOTE: kvcore's own invariant, not user input
                kind = type(spec).__name__
                raise RuntimeError(f"mixer {name} is in a {kind} group")  # noqa: TRY004
            if name not in kv.mixer_backends:
                raise RuntimeError(f"mixer {name} has no mixer backend in the KV cache")
            states = spec.split_states(kv.layer_kv_caches[name])
            self.layers[name] = MixerLayer(module, g, states, kv.mixer_backends[name], max_tokens)
        self.state_groups = sorted({layer.group_id for layer in self.layers.values()})
        self.step: MixerStep | None = None

    @property
    def extra_tokens(self) -> int:
        """Padded tokens one prefill call may take beyond the step budget (see :class:`MixerLayer`)."""
        return max((layer.chunk for layer in self.layers.values() if layer.varlen), default=0)

    @classmethod
    def unbound(cls, modules: Mapping[str, torch.nn.Module], specs: Mapping[str, MambaSpec],
                backends: Mapping[str, Any], device: torch.device) -> MixerRunner:
        """Mixers on zero states of their own, for scratch passes before the KV cache exists."""
        runner, zeros = cls.__new__(cls), lambda spec: [torch.zeros(1, *shape, dtype=dtype, device=device)
                                                        for shape, dtype in zip(spec.shapes, spec.dtypes)]
        runner.layers = {n: MixerLayer(m, 0, zeros(specs[n]), backends[n], 1) for n, m in modules.items()}
        runner.state_groups, runner.step = [0], None
        return runner

    def plan(self, batch: Sequence[tuple[Request | None, int]], tables: Sequence[np.ndarray],
             common: Sequence[CommonAttentionMetadata]) -> MixerStep:
        """This step's mixer work; ``batch`` lists its single-token entries first, ``tables`` are the
        scheduler's and ``common`` the step's metadata (whose state tables hold the slots)."""
        decodes = 0
        while decodes < len(batch) and is_decode(*batch[decodes]):
            decodes += 1
        prefills, start = [], decodes
        for request, n in batch[decodes:]:
            slots = {g: int(tables[g][request.row, 0]) for g in self.state_groups}
            cuts = [(depth - request.num_computed, blocks) for depth, blocks, _ in request.checkpoints]
            prefills.append((start, n, slots, cuts))
            start += n
        slots = {g: common[g].block_table_tensor[:decodes, 0] for g in self.state_groups} if decodes else {}
        return MixerStep(decodes, slots, prefills)

    @contextlib.contextmanager
    def running(self, step: MixerStep) -> Iterator[None]:
        """Serve the mixers' calls from ``step`` for the duration."""
        self.step = step
        try:
            yield
        finally:
            self.step = None

    def copy_states(self, group_slots: dict[int, tuple[list[int], list[int]]]) -> None:
        """Copy state slots of every mixer layer: group -> ``(src, dst)`` (restored checkpoints)."""
        for layer in self.layers.values():
            if layer.group_id in group_slots:
                copy_slots(layer.states, *group_slots[layer.group_id])

    def scratch(self, decodes: int = 0) -> contextlib.AbstractContextManager[None]:
        """Run the mixers on zero states outside the cache for the duration (a warm-up pass of one
        chunk, or of ``decodes`` single tokens)."""
        return self.running(MixerStep(decodes, {}, [], scratch=True))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route every mixer module's calls through :meth:`MixerLayer.run` for the duration."""
        saved = {name: vars(layer.module).get("forward") for name, layer in self.layers.items()}
        for layer in self.layers.values():
            layer.module.forward = functools.partial(self._forward, layer)
        try:
            yield
        finally:
            for name, layer in self.layers.items():
                if saved[name] is None:
                    del layer.module.forward
                else:
                    layer.module.forward = saved[name]

    def _forward(self, layer: MixerLayer, hidden_states: torch.Tensor, *_: Any, **__: Any) -> Any:
        # NOTE: the decoder layer's mask and keyword arguments describe the packed row, which no
        # per-sequence call may see; each call gets only its own tokens and states.
        if self.step is None:
            raise RuntimeError("a kvcore-served mixer was called outside an engine step")
        return layer.run(self.step, hidden_states)
