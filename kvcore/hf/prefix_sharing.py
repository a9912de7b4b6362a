"""Prefix sharing for the engine: start a request at the cached blocks of its prompt prefix.

All KV cache groups must agree on one prefix length, so a hit is the longest prefix every group
caches (a sliding-window group needs only the blocks inside the window), at a boundary of every
group's blocks and short of the last token (whose logits the step needs). After each step,
blocks that became full are recorded under their chained hashes, generated tokens included.
"""

from __future__ import annotations

import collections

import numpy as np

from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.prefix_hash import block_hashes
from kvcore.hf.requests import GroupInfo, Request


class PrefixSharing:
    """Hit lookup and block recording over the prefix cache of a caching :class:`~kvcore.BlockPool`."""

    def __init__(
        self, pool: BlockPool, groups: list[GroupInfo], tables: list[np.ndarray], counts: collections.Counter[str]
    ) -> None:
        if not pool.enable_caching:
            raise ValueError("prefix caching needs a BlockPool built with enable_caching=True")
        self.pool, self.groups, self.counts = pool, groups, counts
        #: The scheduler's block tables (one row per running request and group).
        self.tables = tables

    def _hashes(self, request: Request, block_size: int, num_blocks: int) -> list[bytes]:
        """The first ``num_blocks`` chained hashes of ``request``'s tokens (kept on the request)."""
        hashes = request.block_hashes.setdefault(block_size, [])
        if len(hashes) < num_blocks:
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else None
            hashes.extend(block_hashes(request.tokens[start : num_blocks * block_size], block_size, parent=parent))
        return hashes[:num_blocks]

    def lookup(self, request: Request) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of ``request`` short of its last token, and its blocks per group.

        Each returned block gains a reference (the caller holds it).
        """
        groups, pool, limit = self.groups, self.pool, request.num_tokens - 1
        hashes = [self._hashes(request, g.block_size, limit // g.block_size) for g in groups]
        tokens = pool.find_common_prefix(
            {i: (h, g.block_size, g.window_blocks) for i, (g, h) in enumerate(zip(groups, hashes))},
            max_tokens=limit,
        )
        ids: list[list[int]] = [[] for _ in groups]
        for i, (g, h) in enumerate(zip(groups, hashes)):
            if tokens:
                ids[i] = pool.get_cached_blocks(h[: tokens // g.block_size], group_id=i, window=g.window_blocks)
            if len(ids[i]) * g.block_size != tokens:
                raise RuntimeError(f"group {i}: prefix cache returned {len(ids[i])} blocks for {tokens} tokens")
        return tokens, ids

    def admit(self, request: Request) -> None:
        """Start ``request`` at its longest cached prefix: shared blocks, no prefill for them."""
        tokens, hit = self.lookup(request)
        if tokens == 0:
            return
        for i, ids in enumerate(hit):
            self.tables[i][request.row, : len(ids)] = ids
            request.num_blocks[i] = request.num_cached_blocks[i] = len(ids)
            request.window_start[i] = next((j for j, b in enumerate(ids) if b), len(ids))
        request.num_computed = tokens
        self.counts["prefix_cache_hits"] += 1
        self.counts["prefix_cache_hit_tokens"] += tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Record the blocks of ``request`` that the last step filled."""
        for i, g in enumerate(self.groups):
            full, done = request.num_computed // g.block_size, request.num_cached_blocks[i]
            if full <= done:
                continue
            hashes = self._hashes(request, g.block_size, full)[done:full]
            pairs = [(h, b) for h, b in zip(hashes, self.tables[i][request.row, done:full].tolist()) if b]
            if pairs:
                self.pool.cache_blocks([h for h, _ in pairs], [b for _, b in pairs], group_id=i)
            request.num_cached_blocks[i] = full
