"""Each KV cache group as the engine serves it: block size, sliding window, state slot.

Worked out once per group from the group's spec when the engine is built;
the scheduler, prefix sharing, the engine and the attention bindings read
these records and never look at the spec again.
"""

from __future__ import annotations

import attrs

from kvcore.runtime.prefix_hash import sliding_window_blocks
from kvcore.specs.attention import SlidingWindowSpec
from kvcore.specs.base import KVCacheSpec
from kvcore.specs.state import MambaSpec


@attrs.frozen
class GroupInfo:
    """One KV cache group as the engine serves it (read by scheduler, prefix sharing and bindings)."""

    block_size: int
    #: Tokens of the sliding window, None for full attention.
    sliding_window: int | None
    #: A state group: one block (the request's state slot) whatever its length.
    state: bool = False
    #: Blocks a prefix-cache hit needs in this group (the window before the next token); None: all.
    window_blocks: int | None = attrs.field(init=False)

    @window_blocks.default
    def _window_blocks(self) -> int | None:
        return None if self.sliding_window is None else sliding_window_blocks(self.sliding_window, self.block_size)

    @classmethod
    def of(cls, spec: KVCacheSpec) -> GroupInfo:
        """The record of a KV cache group whose layers share ``spec``."""
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
