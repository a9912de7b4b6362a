"""What ``kvcore.hf.Engine`` serves with when the caller does not say: backend, block size, step budget.

``backend="auto"`` is :func:`kvcore.select_backend`'s pick per layer spec for the model's device.
The block size defaults to the first attention layer's backend's preference (16 when it states
none), grown for a hybrid until an attention page holds a state page; the tokens per step to 4,096
on a GPU and 2,048 elsewhere (the budget ``kvcore bench hf`` measured fastest with on the H200).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from kvcore.plugins.auto import AUTO, preferred_block_size, select_backend
from kvcore.specs import KVCacheSpec

#: Block size when the backend prefers none.
BLOCK_SIZE = 16
#: Tokens per step by device type (others: the CPU figure).
BATCHED_TOKENS = {"cuda": 4096, "cpu": 2048}


@attrs.frozen
class EngineDefaults:
    """The resolved settings of one engine."""

    block_size: int
    max_num_batched_tokens: int
    #: Backend (class or name) of every layer, "auto" resolved.
    layer_backends: dict[str, Any]
    #: The layer specs at ``block_size``.
    specs: Mapping[str, KVCacheSpec] = attrs.field(repr=False, factory=dict)


def resolve(
    make_specs: Callable[[int], Mapping[str, KVCacheSpec]],
    device: torch.device,
    backend: Any,
    block_size: int | None,
    max_num_batched_tokens: int | None,
) -> EngineDefaults:
    """Resolve ``"auto"`` and unset sizes; ``make_specs(block_size)`` gives the layer specs."""
    specs = make_specs(BLOCK_SIZE if block_size is None else block_size)
    attention = {n: s for n, s in specs.items() if s.is_attention}

    def pick(spec: KVCacheSpec) -> Any:
        return select_backend(spec, device) if isinstance(backend, str) and backend == AUTO else backend

    if block_size is None and attention:
        first = next(iter(attention.values()))
        block_size = preferred_block_size(pick(first), first) or BLOCK_SIZE
        block_size *= _state_page_multiple(specs, attention)
        if block_size != BLOCK_SIZE:
            specs = make_specs(block_size)
            attention = {n: s for n, s in specs.items() if s.is_attention}
    if max_num_batched_tokens is None:
        max_num_batched_tokens = BATCHED_TOKENS.get(device.type, BATCHED_TOKENS["cpu"])
    return EngineDefaults(
        block_size or BLOCK_SIZE, max_num_batched_tokens, {n: pick(s) for n, s in attention.items()}, specs
    )


def _state_page_multiple(specs: Mapping[str, KVCacheSpec], attention: Mapping[str, KVCacheSpec]) -> int:
    """How many times the attention block must grow so its page holds a state page (1: no state caches).

    A hybrid's pages are unified to the largest (SPEC §6): padding every attention page up to a
    whole Mamba state would waste most of the cache, larger attention blocks at most one attention
    page per state page.
    """
    states = [s.real_page_size_bytes for s in specs.values() if not s.is_attention and s.has_cache_pages]
    pages = [s.real_page_size_bytes for s in attention.values()]
    # NOTE: below twice the attention page, padding attention wastes less than padding states would.
    if not states or not pages or max(states) < 2 * max(pages):
        return 1
    return -(-max(states) // max(pages))
