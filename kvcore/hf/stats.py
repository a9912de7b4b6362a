"""What an engine has done so far: counts, and host time per phase of a step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs

#: Phases of a step, in order, timed on the host (see :class:`EngineStats`).
PHASES = ("schedule", "prepare", "zero", "forward", "sample")


@attrs.frozen
class EngineStats(Mapping):
    """A snapshot of :meth:`kvcore.hf.Engine.stats`: read fields as attributes or keys.

    ``prefill_tokens`` were computed for a prompt (or recomputed after a preemption),
    ``decode_tokens`` for generated tokens; prefix-cache hits are shared, never zeroed. The ``*_s``
    fields are host seconds per step phase (``sample_s`` includes waiting for the device).
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_finished: int = 0
    blocks_allocated: int = 0
    blocks_zeroed: int = 0
    window_freed_blocks: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    #: Decode steps replayed from CUDA graphs (``kvcore.hf.graphs``).
    graph_steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    zero_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0

    def __getitem__(self, key: str) -> int | float:
        return attrs.asdict(self)[key]

    def __iter__(self) -> Iterator[str]:
        return iter(attrs.fields_dict(type(self)))

    def __len__(self) -> int:
        return len(attrs.fields(type(self)))
