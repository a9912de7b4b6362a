"""The pool of manager block ids a scheduler hands to sequences.

Block 0 is the null block: it is never handed out, so a block table can use
it as padding (or for blocks a sliding window no longer needs) and kernels
reading it read memory no live sequence owns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvcore._validate import as_int, non_negative_int, positive_int
from kvcore.errors import OutOfBlocksError

NULL_BLOCK_ID = 0


class BlockPool:
    """Free list of block ids ``1 .. num_blocks - 1``.

    ``allocate`` and ``free`` cost O(1) per block (a deque of free ids and a
    bytearray marking ids in use). Ids come back in first-freed, first-reused
    order. Every id allocated since the last :meth:`take_new_blocks` is
    remembered so the caller can zero it before a kernel reads it.
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = positive_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block {NULL_BLOCK_ID} is the "
                f"reserved null block), got num_blocks={num_blocks}; plan more blocks"
            )
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._in_use = bytearray(num_blocks)
        self._new: list[int] = []

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - 1 - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks in use (0.0 .. 1.0)."""
        return self.num_used_blocks / (self._num_blocks - 1)

    def is_allocated(self, block_id: int) -> bool:
        block_id = as_int("block_id", block_id)
        return 0 <= block_id < self._num_blocks and bool(self._in_use[block_id])

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` block ids, or none at all.

        :raises OutOfBlocksError: fewer than ``n`` blocks are free (the
            error carries ``requested`` and ``free``); nothing is allocated.
        """
        n = non_negative_int("number of blocks to allocate", n)
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        for block_id in ids:
            self._in_use[block_id] = 1
        self._new.extend(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool.

        Every id is checked before any is freed: the null block, ids outside
        the pool, ids not allocated (double frees) and ids repeated within the
        call raise ``ValueError`` and leave the pool unchanged.
        """
        ids = [as_int("block id", b) for b in block_ids]
        seen: set[int] = set()
        for block_id in ids:
            if block_id == NULL_BLOCK_ID:
                raise ValueError(
                    f"block {NULL_BLOCK_ID} is the reserved null block and is never "
                    "allocated; drop it from the ids to free (e.g. padding in a block table)"
                )
            if not 0 < block_id < self._num_blocks:
                raise ValueError(
                    f"block id {block_id} is outside this pool of {self._num_blocks} "
                    f"blocks; valid ids are 1..{self._num_blocks - 1}"
                )
            if block_id in seen:
                raise ValueError(f"block {block_id} appears twice in one free() call; list each block once")
            if not self._in_use[block_id]:
                raise ValueError(
                    f"block {block_id} is not allocated (double free?); free each "
                    "allocated block exactly once"
                )
            seen.add(block_id)
        for block_id in ids:
            self._in_use[block_id] = 0
        self._free.extend(ids)

    def take_new_blocks(self) -> list[int]:
        """Ids allocated since the last call that are still in use, each once.

        A block freed before this call is left out: it is zeroed when it is
        next allocated.
        """
        new, self._new = self._new, []
        in_use = self._in_use
        return [b for b in dict.fromkeys(new) if in_use[b]]

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, free={len(self._free)})"
