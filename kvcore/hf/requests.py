"""What the scheduler keeps: each KV cache group's record, each request, and a new request's checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvcore._validate import as_int
from kvcore.runtime.prefix_hash import sliding_window_blocks
from kvcore.specs.attention import SlidingWindowSpec
from kvcore.specs.base import KVCacheSpec
from kvcore.specs.state import MambaSpec


@attrs.frozen
class GroupInfo:
    """One KV cache group as the engine serves it, worked out once from its spec."""

    block_size: int
    #: Tokens of the sliding window, None for full attention.
    sliding_window: int | None
    #: A state group: one block (the request's state slot) whatever its length.
    state: bool = False

    @property
    def window_blocks(self) -> int | None:
        """Blocks a prefix-cache hit needs in this group (the window before the next token); None: all."""
        return None if self.sliding_window is None else sliding_window_blocks(self.sliding_window, self.block_size)

    @classmethod
    def of(cls, spec: KVCacheSpec) -> GroupInfo:
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        return cls(spec.block_size, window, state=isinstance(spec, MambaSpec))

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` ever holds in this group at once."""
        if self.state:
            return 1
        full = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, (self.sliding_window - 1 + max_chunk) // self.block_size + 2)


@attrs.define(eq=False)
class Request:
    """One prompt being served: its tokens (prompt, then generated) and its blocks per KV cache group.

    ``num_computed`` leading tokens have their K/V in the cache. The block ids live in the request's
    ``row`` of the scheduler's tables while it runs (-1 otherwise): ``num_blocks[g]`` leading entries
    of group ``g``'s row (0, the null block, where a sliding window dropped a block).
    """

    req_id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    num_computed: int = 0
    row: int = -1
    #: Per group: blocks in the request's table row.
    num_blocks: list[int] = attrs.field(factory=list)
    #: Per group: index of the first block a sliding window still needs.
    window_start: list[int] = attrs.field(factory=list)
    #: Chained hashes of the full blocks of ``tokens``, by block size (prefix caching only).
    block_hashes: dict[int, list[bytes]] = attrs.field(factory=dict)
    #: Per group: blocks already recorded in the prefix cache.
    num_cached_blocks: list[int] = attrs.field(factory=list)
    finished: bool = False

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose K/V still have to be computed."""
        return len(self.tokens) - self.num_computed

    def reset(self, num_groups: int) -> None:
        """Forget every block (a new request, or a preempted one to be recomputed)."""
        self.num_blocks = [0] * num_groups
        self.window_start = [0] * num_groups
        self.num_cached_blocks = [0] * num_groups
        self.num_computed = 0
        self.row = -1


def check_prompt(index: int, prompt: Any, max_new_tokens: Any, *, vocab_size: int, max_model_len: int) -> list[int]:
    """``prompt`` as a list of ints, or ``ValueError``/``TypeError`` naming prompt ``index`` and the fix."""
    where = f"prompt {index}"
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"{where} must be a list of token ids, got {type(prompt).__name__}; tokenize it first")
    tokens = [as_int(f"{where} token", t) for t in prompt]
    if not tokens:
        raise ValueError(f"{where} is empty; give at least one token id")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{where} holds token ids {sorted(set(bad))[:8]} outside the vocabulary 0..{vocab_size - 1}; "
            "use the model's own tokenizer"
        )
    new = as_int("max_new_tokens", max_new_tokens)
    if new < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {new}")
    if len(tokens) + new > max_model_len:
        raise ValueError(
            f"{where} has {len(tokens)} tokens; with max_new_tokens={new} it needs {len(tokens) + new} "
            f"positions but the model takes at most {max_model_len} (max_position_embeddings); "
            "shorten the prompt or lower max_new_tokens"
        )
    return tokens
