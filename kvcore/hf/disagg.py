"""Disaggregated serving: hand a prompt's cached KV blocks from one engine's prefix cache to
another's (export, move the bytes with any transport, reserve, import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvcore.hf.scheduler import Request, check_prompt
from kvcore.runtime.block_pool import NULL_BLOCK_ID
from kvcore.runtime.prefix_hash import block_hashes

if TYPE_CHECKING:
    from kvcore.hf.engine import Engine
    from kvcore.hf.scheduler import Scheduler


@attrs.frozen
class PrefixBlocks:
    """A prompt prefix (a multiple of every group's block size) and its blocks in one engine, one
    id per block per group (0 before a sliding window). Plain data: it pickles."""

    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    block_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=lambda ids: tuple(tuple(g) for g in ids))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def held_ids(self, group_id: int) -> list[int]:
        """Group ``group_id``'s blocks that hold K/V (the ones to move), in prefix order."""
        return [b for b in self.block_ids[group_id] if b != NULL_BLOCK_ID]


def _scheduler(engine: Engine) -> Scheduler:
    if not engine.scheduler.prefix_caching:
        raise ValueError("prefix hand-off needs an Engine built with enable_prefix_caching=True")
    return engine.scheduler


def _check(engine: Engine, blocks: PrefixBlocks, *, held: bool) -> Scheduler:
    """``blocks`` fits ``engine``'s groups (and, when ``held``, names blocks it holds)."""
    if not isinstance(blocks, PrefixBlocks):
        raise TypeError(f"expected kvcore.hf.disagg.PrefixBlocks, got {type(blocks).__name__}")
    scheduler = _scheduler(engine)
    groups = scheduler.groups
    if len(blocks.block_ids) != len(groups):
        raise ValueError(
            f"the prefix lists blocks of {len(blocks.block_ids)} KV cache groups but this engine has "
            f"{len(groups)}; both engines must serve the same model"
        )
    sizes = [g.block_size for g in groups]
    if any(blocks.num_tokens % s for s in sizes):
        raise ValueError(
            f"a prefix of {blocks.num_tokens} tokens is not a multiple of this engine's block sizes {sizes}; "
            "both engines must use the same block_size"
        )
    for g, (group, ids) in enumerate(zip(groups, blocks.block_ids)):
        n = blocks.num_tokens // group.block_size
        start = 0 if group.window_blocks is None else max(0, n - group.window_blocks)  # outside the window
        shape = [i != NULL_BLOCK_ID for i in ids]
        if shape != [False] * start + [True] * (n - start):
            raise ValueError(
                f"group {g}: a prefix of {blocks.num_tokens} tokens needs {n - start} blocks after {start} "
                f"null ones here, got ids {list(ids)}; both engines must serve the same model and block size"
            )
        if held:
            missing = [b for b in ids if b != NULL_BLOCK_ID and not engine.kv.block_pool.is_allocated(b)]
            if missing:
                raise ValueError(f"group {g}: blocks {missing} are not held by this engine (released already?)")
    return scheduler


def export_prefix(engine: Engine, prompt: Sequence[int]) -> PrefixBlocks:
    """The blocks of ``prompt``'s cached prefix in ``engine``, each held until :func:`release_prefix`.

    Run the prompt first; the prefix may be empty (a short prompt, or blocks evicted).
    """
    scheduler = _scheduler(engine)
    tokens = check_prompt(0, prompt, 1, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len)
    num_tokens, ids = scheduler.lookup(Request(-1, tokens, len(tokens), 1))
    return PrefixBlocks(tokens[:num_tokens], ids)


def reserve_prefix(engine: Engine, like: PrefixBlocks) -> PrefixBlocks:
    """Fresh blocks of ``engine`` for the prefix ``like`` describes, zeroed now (call it between steps).

    Fill them, then :func:`import_prefix` (or :func:`release_prefix` to give up).
    :raises kvcore.errors.OutOfBlocksError: the pool lacks the blocks; nothing is held.
    """
    scheduler = _check(engine, like, held=False)
    counts = [len(like.held_ids(g)) for g in range(len(scheduler.groups))]
    fresh = iter(engine.kv.block_pool.allocate(sum(counts)))
    engine.kv.begin_step()
    ids = [[next(fresh) if b != NULL_BLOCK_ID else NULL_BLOCK_ID for b in group] for group in like.block_ids]
    return PrefixBlocks(like.tokens, ids)


def import_prefix(engine: Engine, blocks: PrefixBlocks) -> None:
    """Cache ``blocks`` (reserved, now filled) in ``engine``'s prefix cache and release them."""
    scheduler = _check(engine, blocks, held=True)
    pool = engine.kv.block_pool
    plans = []
    for g, group in enumerate(scheduler.groups):
        hashes = block_hashes(list(blocks.tokens), group.block_size)
        pairs = [(h, b) for h, b in zip(hashes, blocks.block_ids[g]) if b != NULL_BLOCK_ID]
        taken = [b for h, b in pairs if pool.block_hash(b) not in (None, (g, h))]
        if taken:
            raise ValueError(f"group {g}: blocks {taken} are cached under other contents; import only reserved blocks")
        plans.append(pairs)
    for g, pairs in enumerate(plans):
        pool.cache_blocks([h for h, _ in pairs], [b for _, b in pairs], group_id=g)
    release_prefix(engine, blocks)


def release_prefix(engine: Engine, blocks: PrefixBlocks) -> None:
    """Drop this holder's reference to every block of ``blocks``, once (last first: evicted first)."""
    _check(engine, blocks, held=True)
    held = [b for g in range(len(blocks.block_ids)) for b in reversed(blocks.held_ids(g))]
    engine.kv.block_pool.free(held)
