"""Prefix caching for a hybrid's state groups: a checkpoint of every state group at each multiple
of ``state_checkpoint_tokens`` a request's prefill passes, in a state block cached under the
chained hash of that prefix; a request that matches one restores it into its own slot."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore.runtime.block_pool import BlockPool


class StateCheckpoints:
    """The state pool's checkpoints, for one engine's scheduler. A request carries ``restore``
    (group -> the checkpoint to copy into its slot, held until the copy is issued) and this step's
    ``checkpoints`` (depth, group -> block, hash), held until written and cached."""

    def __init__(self, pool: BlockPool, groups: Sequence[int], tokens: int,
                 hashes: Callable[..., list[bytes]], max_num_seqs: int) -> None:
        self.pool, self.groups, self.tokens, self.hashes = pool, list(groups), tokens, hashes
        self.max_num_seqs = max_num_seqs

    def plan(self, request, num_tokens: int, num_running: int) -> None:
        """Blocks for the checkpoints ``request`` passes in its next ``num_tokens`` prefill tokens
        (multiples of ``tokens`` up to its prompt, not cached yet), deepest first while slots stay
        free for the sequences still to be admitted; those it cannot have are skipped."""
        start, size = request.num_computed, self.tokens
        last = min(start + num_tokens, request.prompt_len) // size
        if last * size <= start:
            return
        hashes = self.hashes(request, size, last)
        spare = self.pool.num_free_blocks - len(self.groups) * (self.max_num_seqs - num_running)
        for index in range(last - 1, start // size - 1, -1):
            key = hashes[index]
            if any(self.pool.find_cached_prefix([key], group_id=g) for g in self.groups):
                continue  # NOTE: another request checkpointed that prefix already
            if spare < len(self.groups):
                break
            blocks = dict(zip(self.groups, self.pool.allocate(len(self.groups))))
            spare -= len(self.groups)
            request.checkpoints.insert(0, ((index + 1) * size, blocks, key))

    def take_restores(self, requests: Sequence) -> dict[int, tuple[list[int], list[int]]]:
        """Per group, ``(checkpoints, slots)`` to copy before the step runs (``requests``: a request
        and its slot per group each); the references go (no block is handed out before the copy)."""
        pairs: dict[int, tuple[list[int], list[int]]] = {}
        for request, slots in requests:
            for g, block in request.restore.items():
                src, dst = pairs.setdefault(g, ([], []))
                src.append(block)
                dst.append(slots[g])
            self.pool.free(list(request.restore.values()))
            request.restore = {}
        return pairs

    def cache(self, request) -> None:
        """Record the checkpoints the last step wrote, then let them go (evictable, LRU)."""
        for _, blocks, key in request.checkpoints:
            for g, block in blocks.items():
                if not self.pool.find_cached_prefix([key], group_id=g):
                    self.pool.cache_blocks([key], [block], group_id=g)
            self.pool.free(list(blocks.values()))
        request.checkpoints = []

    def release(self, request) -> None:
        """Drop what ``request`` holds here (preempted, finished or aborted)."""
        held = [*request.restore.values(), *(b for _, blocks, _ in request.checkpoints for b in blocks.values())]
        if held:
            self.pool.free(held)
        request.restore, request.checkpoints = {}, []
