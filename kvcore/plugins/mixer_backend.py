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
