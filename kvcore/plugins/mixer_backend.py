"""The protocol a mixer backend implements: a class (never instantiated by kvcore) with a unique
``name`` and the ``mamba_types`` it serves, which runs a hybrid model's mixer layers (Mamba2,
short convolutions, gated delta nets, ...) on their states in kvcore's state caches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch


class MixerBackend:
    """Base class of mixer backends, registered through ``kvcore_register_backends`` like
    attention backends and chosen by :func:`kvcore.select_backend` for a ``MambaSpec`` whose
    ``mamba_type`` is in :attr:`mamba_types`.

    ``states`` are the layer's state views in the cache, one ``[num_slots, *shape]`` tensor per
    state shape of its spec (``MambaSpec.split_states``); a sequence's state is slot ``s`` of
    each. Both methods update the states in place and return the mixer's output.
    """

    name: ClassVar[str]
    #: The ``MambaSpec.mamba_type`` values this backend runs.
    mamba_types: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @staticmethod
    def decode(
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        states: Sequence[torch.Tensor],
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        """One new token for each of ``T`` sequences, all in one call.

        :param layer: the model's mixer module (its weights and settings). While an engine
            serves, calls to the module itself route back to the engine: run its own code as
            ``type(layer).forward(layer, ...)``.
        :param hidden_states: ``[T, hidden]``, row ``i`` the token of the sequence in
            ``slot_ids[i]``.
        :param slot_ids: integer tensor ``[T]`` on the states' device. Under a CUDA graph,
            padding rows point at a slot nothing reads (they may repeat); the call must not
            synchronize the device.
        :returns: ``[T, hidden]``.
        """
        raise NotImplementedError(
            f"{MixerBackend.__qualname__}.decode is the protocol; a mixer backend overrides it"
        )

    @staticmethod
    def prefill(
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        states: Sequence[torch.Tensor],
        slot_id: int,
    ) -> torch.Tensor:
        """A chunk of ``n`` tokens of one sequence, continuing from the state in ``slot_id``
        (a fresh sequence's slot holds zeros).

        :param hidden_states: ``[n, hidden]``. :returns: ``[n, hidden]``.
        """
        raise NotImplementedError(
            f"{MixerBackend.__qualname__}.prefill is the protocol; a mixer backend overrides it"
        )

    @classmethod
    def prefill_batch(
        cls,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        states: Sequence[torch.Tensor],
        slot_ids: Sequence[int],
    ) -> torch.Tensor:
        """Chunks of ``n`` tokens of ``k`` sequences at once (``hidden_states`` ``[k, n, hidden]``,
        ``slot_ids`` their slots); returns ``[k, n, hidden]``. By default one :meth:`prefill` each;
        a backend overrides it when it runs a batch faster and exactly.
        """
        return torch.stack(
            [cls.prefill(layer, chunk, states, slot) for chunk, slot in zip(hidden_states, slot_ids)]
        )


def is_mixer_backend(backend: Any) -> bool:
    """Whether ``backend`` is a :class:`MixerBackend` subclass."""
    return isinstance(backend, type) and issubclass(backend, MixerBackend)


def mixer_problem(backend: type[MixerBackend]) -> str | None:
    """Why ``backend`` cannot be registered as a mixer backend (None: it can)."""
    types = getattr(backend, "mamba_types", None)
    if not isinstance(types, tuple) or not types or not all(isinstance(t, str) and t for t in types):
        return (
            f"registered {backend.__qualname__} with mamba_types={types!r}; a mixer backend lists "
            "the mamba types it serves as a non-empty tuple of str, e.g. ('mamba2',)"
        )
    for method in ("decode", "prefill"):
        if getattr(backend, method) is getattr(MixerBackend, method):
            return f"registered {backend.__qualname__}, which does not implement {method}()"
    return None
