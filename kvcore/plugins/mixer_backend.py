"""The protocol a mixer backend implements: a class (never instantiated by kvcore) with a unique
``name`` and the ``mamba_types`` it runs, serving a hybrid model's mixer layers (Mamba2, short
convolutions, gated delta nets) on their states in kvcore's state caches (docs/hybrid-models.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch


class MixerBackend:
    """Base class of mixer backends, registered like attention backends and chosen by
    :func:`kvcore.select_backend` for a ``MambaSpec`` whose ``mamba_type`` it lists.

    ``states``: the layer's state views in the cache, one ``[num_slots, *shape]`` tensor per state
    of its spec (``MambaSpec.split_states``). Both methods update them in place at the slots given
    and return the mixer's output; ``layer`` is the model's mixer module (whose own code, while an
    engine serves, runs as ``type(layer).forward(layer, ...)``).
    """

    name: ClassVar[str]
    mamba_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @staticmethod
    def decode(layer: torch.nn.Module, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
               slot_ids: torch.Tensor) -> torch.Tensor:
        """One new token for each of ``T`` sequences in one call: ``hidden_states`` ``[T, hidden]``,
        ``slot_ids`` an integer tensor ``[T]``; returns ``[T, hidden]``. Under a CUDA graph, padding
        rows carry a slot nothing reads (maybe repeated), and nothing may synchronize the device."""
        raise NotImplementedError("MixerBackend.decode is the protocol; a mixer backend overrides it")

    @staticmethod
    def prefill(layer: torch.nn.Module, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                slot_id: int) -> torch.Tensor:
        """``n`` tokens of one sequence (``[n, hidden]``) continuing from the state in ``slot_id``
        (zeros for a new sequence); returns ``[n, hidden]``."""
        raise NotImplementedError("MixerBackend.prefill is the protocol; a mixer backend overrides it")

    @classmethod
    def prefill_batch(cls, layer: torch.nn.Module, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                      slot_ids: Sequence[int]) -> torch.Tensor:
        """Equal-length chunks of ``k`` sequences (``[k, n, hidden]``, their slots); by default one
        :meth:`prefill` each, overridden by a backend that batches them exactly."""
        return torch.stack([cls.prefill(layer, chunk, states, slot) for chunk, slot in zip(hidden_states, slot_ids)])

    @classmethod
    def prefill_varlen(cls, layer: torch.nn.Module, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                       slot_ids: Sequence[int], lengths: Sequence[int],
                       checkpoints: Sequence[Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
        """Chunks of ``k`` sequences of different lengths, right-padded to the longest: row ``i`` of
        ``hidden_states`` ``[k, n, hidden]`` holds ``lengths[i]`` tokens, then padding; returns
        ``[k, n, hidden]``, whose padding positions mean nothing. ``checkpoints`` (None: none) keeps
        row states part-way, as in :meth:`prefill_checkpoints` (``0 < tokens <= lengths[i]``). By
        default the rows of each length go to :meth:`prefill_batch` (or :meth:`prefill_checkpoints`)
        together. A backend whose scan can run past a row's end without changing its state
        overrides this, and the engine then batches chunks of different lengths (up to the same
        number of scan chunks) in one call."""
        out = torch.zeros_like(hidden_states)
        for n in sorted(set(lengths)):
            rows = [i for i, length in enumerate(lengths) if length == n]
            slots = [slot_ids[i] for i in rows]
            cuts = [checkpoints[i] for i in rows] if checkpoints else None
            out[rows, :n] = prefill_equal(cls, layer, hidden_states[rows, :n], states, slots, cuts)
        return out

    @classmethod
    def prefill_checkpoints(cls, layer: torch.nn.Module, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                            slot_ids: Sequence[int], checkpoints: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
        """Equal-length chunks as :meth:`prefill_batch` that also keep each row's states after some of
        its tokens: ``checkpoints[i]`` lists ``(tokens, slot)`` for row ``i`` (``0 < tokens <= n``),
        and the states of row ``i`` after its first ``tokens`` tokens are copied to ``slot`` (the
        prefix caching of a hybrid). By default the chunks run in pieces ending at every checkpoint;
        a backend whose scan passes those points anyway overrides this to run them in one call."""
        n = hidden_states.shape[1]
        ends = sorted({n, *(tokens for row in checkpoints for tokens, _ in row)})
        pieces = []
        for start, end in zip([0, *ends], ends):
            part = hidden_states[:, start:end]
            pieces.append(prefill_equal(cls, layer, part, states, slot_ids))
            taken = [(slot, keep) for slot, row in zip(slot_ids, checkpoints) for tokens, keep in row if tokens == end]
            copy_slots(states, [slot for slot, _ in taken], [keep for _, keep in taken])
        return torch.cat(pieces, dim=1)


def prefill_equal(backend: type[MixerBackend], layer: torch.nn.Module, hidden_states: torch.Tensor,
                  states: Sequence[torch.Tensor], slot_ids: Sequence[int],
                  checkpoints: Sequence[Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
    """Equal-length chunks ``[k, n, hidden]`` through ``backend``: ``prefill_checkpoints`` when a row
    keeps checkpoints, else ``prefill`` for one row and ``prefill_batch`` for several."""
    if checkpoints and any(checkpoints):
        return backend.prefill_checkpoints(layer, hidden_states, states, slot_ids, checkpoints)
    if len(slot_ids) == 1:
        return backend.prefill(layer, hidden_states[0], states, slot_ids[0])[None]
    return backend.prefill_batch(layer, hidden_states, states, slot_ids)


def copy_slots(states: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy each state of slots ``src`` to slots ``dst`` (a checkpoint taken or restored)."""
    if src:
        index = torch.tensor([list(src), list(dst)], dtype=torch.long).to(states[0].device, non_blocking=True)
        for state in states:
            state.index_copy_(0, index[1], state.index_select(0, index[0]))


def batches_varlen(backend: type[MixerBackend]) -> bool:
    """Whether ``backend`` runs chunks of different lengths in one :meth:`MixerBackend.prefill_varlen`
    call (it overrides the default, which runs each length on its own)."""
    method = getattr(backend, "prefill_varlen", None)
    return method is not None and getattr(method, "__func__", method) is not MixerBackend.prefill_varlen.__func__


def is_mixer_backend(backend: Any) -> bool:
    return isinstance(backend, type) and issubclass(backend, MixerBackend)


def mixer_problem(backend: type[MixerBackend]) -> str | None:
    """Why ``backend`` cannot be registered as a mixer backend (None: it can)."""
    types = getattr(backend, "mamba_types", None)
    if not isinstance(types, tuple) or not types or not all(isinstance(t, str) and t for t in types):
        return (f"registered {backend.__qualname__} with mamba_types={types!r}; a mixer backend lists the "
                "mamba types it runs as a non-empty tuple of str, e.g. ('mamba2',)")
    missing = [m for m in ("decode", "prefill") if getattr(backend, m) is getattr(MixerBackend, m)]
    return f"registered {backend.__qualname__}, which does not implement {missing[0]}()" if missing else None
