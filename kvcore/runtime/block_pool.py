"""The pool of manager block ids a scheduler hands to sequences, with an optional prefix cache.

Block 0 is the null block: it is never handed out, so a block table can use
it as padding (or for blocks a sliding window no longer needs) and kernels
reading it read memory no live sequence owns.

With ``enable_caching=True`` a full block whose contents are written can be
recorded under its chained hash (:func:`kvcore.block_hashes`); later requests
with the same prefix share it instead of recomputing it (see
:mod:`kvcore.runtime.prefix_cache` for what each kind of group may cache).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from kvcore._validate import as_int, non_negative_int, positive_int
from kvcore.errors import OutOfBlocksError
from kvcore.runtime.prefix_cache import PrefixCache, check_groups, check_hashes, check_window

NULL_BLOCK_ID = 0
#: Most blocks one pool manages: its host bookkeeping costs about 50 bytes a
#: block (3 GiB here), and no device holds more pages of a useful size.
MAX_NUM_BLOCKS = 1 << 26


class BlockPool:
    """Free list of block ids ``1 .. num_blocks - 1``, optionally with a prefix cache.

    Without caching, ``allocate`` and ``free`` cost O(1) per block (a deque of
    free ids and a bytearray marking ids in use) and ids come back in
    first-freed, first-reused order.

    With caching, every block has a reference count, and free blocks are
    plain (no cached contents) or evictable (cached, nobody holds them; kept
    least recently freed first). ``allocate`` takes plain blocks first and
    evicts only when none is left; an evicted block's hash stops hitting.
    Each KV cache group has its own cache, named by ``group_id``: one pool
    serves every group (block ids are global) and a hash cached in one group
    never hits in another. Allocate, free, hit and evict are O(1) per block.

    :meth:`take_new_blocks` reports the blocks that need zeroing: those handed
    out by ``allocate`` (fresh or evicted) since the last call and still held;
    cache hits are never reported.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False) -> None:
        num_blocks = positive_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block {NULL_BLOCK_ID} is the "
                f"reserved null block), got num_blocks={num_blocks}; plan more blocks"
            )
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(
                f"num_blocks={num_blocks:,} is more than the {MAX_NUM_BLOCKS:,} blocks a BlockPool "
                "manages (its host bookkeeping takes about 50 bytes a block); use larger blocks "
                "(a bigger block_size) or plan fewer of them"
            )
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be True or False, got {enable_caching!r}")
        self._num_blocks = num_blocks
        self._caching = enable_caching
        self._free: deque[int] = deque(range(1, num_blocks))
        # NOTE: one holder table per mode. Caching off: ``_held[b]`` is 1 while b is
        # allocated. Caching on: ``_refs[b]`` counts holders and ``_pending[b]`` is 1
        # from allocate until take_new_blocks reports b (still to be zeroed).
        self._held = bytearray(0 if enable_caching else num_blocks)
        self._pending = bytearray(num_blocks if enable_caching else 0)
        self._new: list[int] = []
        self._refs = [0] * num_blocks if enable_caching else []
        self._cache = PrefixCache()

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return self._num_blocks

    @property
    def enable_caching(self) -> bool:
        return self._caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: plain free plus evictable cached blocks."""
        return len(self._free) + len(self._cache.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one reference."""
        return self._num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks recorded in the prefix cache (held or evictable)."""
        return len(self._cache)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds, kept until ``allocate`` needs them."""
        return len(self._cache.evictable)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks in use (0.0 .. 1.0)."""
        return self.num_used_blocks / (self._num_blocks - 1)

    def is_allocated(self, block_id: int) -> bool:
        block_id = as_int("block_id", block_id)
        if not 0 <= block_id < self._num_blocks:
            return False
        return self._refs[block_id] > 0 if self._caching else bool(self._held[block_id])

    def ref_count(self, block_id: int) -> int:
        """How many holders share ``block_id`` (0 when free; at most 1 without caching)."""
        block_id = self._check_id(block_id)
        return self._refs[block_id] if self._caching else int(self._held[block_id])

    def block_hash(self, block_id: int) -> tuple[int, bytes] | None:
        """``(group_id, hash)`` the block is cached under, or None."""
        return self._cache.key_of(self._check_id(block_id))

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` block ids, or none at all.

        With caching, plain free blocks go first, then the least recently
        freed evictable blocks are evicted.

        :raises OutOfBlocksError: fewer than ``n`` blocks are free (the
            error carries ``requested`` and ``free``); nothing is allocated.
        """
        n = non_negative_int("number of blocks to allocate", n)
        free = self._free
        if not self._caching:
            if n > len(free):
                raise OutOfBlocksError(n, len(free))
            ids = [free.popleft() for _ in range(n)]
            for block_id in ids:
                self._held[block_id] = 1
            self._new.extend(ids)
            return ids
        cache = self._cache
        if n > len(free) + len(cache.evictable):
            raise OutOfBlocksError(n, len(free) + len(cache.evictable))
        take = min(n, len(free))
        ids = [free.popleft() for _ in range(take)]
        if take < n:
            ids.extend(cache.evict_oldest() for _ in range(n - take))
        refs, pending = self._refs, self._pending
        for block_id in ids:
            refs[block_id] = 1
            pending[block_id] = 1
        self._new.extend(ids)
        return ids

    def free(self, block_ids: Iterable[int] | int) -> None:
        """Drop one reference to each block (one id or an iterable of ids).

        With caching, a block whose last reference goes is evictable if it is
        cached (in the order given: free a request's blocks last block first
        so its tail is evicted before its shared head), plain free otherwise.
        A block freed before :meth:`take_new_blocks` reported it was never
        zeroed nor written by a step: it loses its hash. Every id is checked
        before any is freed: the null block, ids outside the pool, ids not
        allocated (double frees) and ids repeated within the call more often
        than they are held raise ``ValueError`` and leave the pool unchanged.
        """
        # NOTE: a 0-d tensor or array is one id, though it is Iterable (and iterating it raises).
        if isinstance(block_ids, Iterable) and getattr(block_ids, "ndim", 1) != 0:
            ids = [as_int("block id", b) for b in block_ids]
        else:
            ids = [as_int("block id", block_ids)]
        num_blocks = self._num_blocks
        for block_id in ids:
            if not 0 < block_id < num_blocks:
                self._check_id(block_id)  # raises, naming the null block or the range
        if not self._caching:
            seen: set[int] = set()
            for block_id in ids:
                if block_id in seen:
                    raise ValueError(f"block {block_id} appears twice in one free() call; list each block once")
                if not self._held[block_id]:
                    raise ValueError(
                        f"block {block_id} is not allocated (double free?); free each "
                        "allocated block exactly once"
                    )
                seen.add(block_id)
            for block_id in ids:
                self._held[block_id] = 0
            self._free.extend(ids)
            return
        refs = self._refs
        for block_id, count in (Counter(ids) if len(ids) > 1 else {b: 1 for b in ids}).items():
            if count > refs[block_id]:
                if refs[block_id] == 0:
                    raise ValueError(
                        f"block {block_id} is not allocated (double free?); free each "
                        "allocated block once per reference"
                    )
                raise ValueError(
                    f"block {block_id} appears {count} times in one free() call but has only "
                    f"{refs[block_id]} reference(s) (double free?); free it once per holder"
                )
        pending, cache, cached = self._pending, self._cache, self._cache.keys
        for block_id in ids:
            left = refs[block_id] - 1
            refs[block_id] = left
            if left == 0:
                if pending[block_id]:
                    pending[block_id] = 0
                    cache.drop(block_id)
                if block_id in cached:
                    cache.evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def find_cached_prefix(
        self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` a hit would cover; changes nothing.

        ``window=None`` (full attention): the longest prefix whose blocks are
        all cached. ``window=w`` (sliding window of ``w`` blocks, see
        :func:`kvcore.sliding_window_blocks`): the longest prefix whose last
        ``w`` blocks are cached (all of it when shorter than ``w``). Without
        caching: always 0.
        """
        hashes = check_hashes(hashes)
        group_id = non_negative_int("group_id", group_id)
        return self._cache.hit_range(hashes, group_id, check_window(window))[1]

    def find_common_prefix(
        self, groups: Mapping[int, tuple[Sequence[bytes], int, int | None]], *, max_tokens: int | None = None
    ) -> int:
        """Tokens of the longest prefix that every listed group hits; changes nothing.

        ``groups[group_id] = (hashes, block_size, window)`` for each group that
        caches (a hybrid model's full and sliding-window groups; a model with
        a state group has no hit unless its engine caches states exactly).
        ``max_tokens`` caps the hit (say, one less than the prompt, so a step
        still computes the last token). The answer is a multiple of every
        block size; then call :meth:`get_cached_blocks` per group with
        ``hashes[: tokens // block_size]``.
        """
        checked = check_groups(groups)
        if not checked:
            return 0
        limit = min(len(h) * bs for _, h, bs, _ in checked)
        if max_tokens is not None:
            limit = min(limit, non_negative_int("max_tokens", max_tokens))
        return self._cache.common_prefix(checked, limit)

    def get_cached_blocks(
        self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None
    ) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``; each gains a reference.

        The prefix is the one :meth:`find_cached_prefix` measures. With a
        ``window``, the positions before the window hold ``NULL_BLOCK_ID`` (0),
        take no reference and must be left out of :meth:`free`. Hits are
        shared, not new: never reported by :meth:`take_new_blocks`, never to be
        zeroed or written.
        """
        hashes = check_hashes(hashes)
        group_id = non_negative_int("group_id", group_id)
        start, end = self._cache.hit_range(hashes, group_id, check_window(window))
        if end == 0:
            return []
        ids = self._cache.blocks(hashes[start:end], group_id)
        refs, evictable = self._refs, self._cache.evictable
        for block_id in ids:
            if refs[block_id] == 0:
                del evictable[block_id]
            refs[block_id] += 1
        return [NULL_BLOCK_ID] * start + ids

    def cache_blocks(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, group_id: int = 0) -> None:
        """Record held, full blocks under their hashes: ``hashes[i]`` is ``block_ids[i]``'s.

        Call it once a block is full and the step that writes it has begun
        (:meth:`take_new_blocks` reported it). A block already cached under the same key is
        left as it is, so a request's whole prefix may be re-cached each step;
        a hash the group already caches keeps its first block and this one
        stays uncached. Refused, pool unchanged: caching off, lists of
        different lengths (a partial block has no hash), ids not allocated or
        repeated, a block no step has been handed yet (still to be zeroed),
        a block cached under another hash or group.
        """
        if not self._caching:
            raise ValueError("this BlockPool was built without prefix caching; pass enable_caching=True")
        hashes = check_hashes(hashes)
        ids = [as_int("block id", b) for b in block_ids]
        group_id = non_negative_int("group_id", group_id)
        if len(hashes) != len(ids):
            raise ValueError(
                f"cache_blocks got {len(hashes)} hashes for {len(ids)} block ids; give one hash per "
                "block (block_hashes hashes full blocks only: a partial last block cannot be cached)"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"cache_blocks got a block id twice in {ids}; list each block once")
        refs, keys, num_blocks = self._refs, self._cache.keys, self._num_blocks
        for h, block_id in zip(hashes, ids):
            if not 0 < block_id < num_blocks:
                self._check_id(block_id)  # raises
            if refs[block_id] == 0:
                raise ValueError(
                    f"block {block_id} is not allocated; cache only blocks you hold, "
                    "once their contents are written"
                )
            if self._pending[block_id]:  # NOTE: no step has zeroed (or written) it yet
                raise ValueError(
                    f"block {block_id} was allocated but no step has been handed it yet (take_new_blocks / "
                    "KVCache.begin_step has not reported it, so it is still to be zeroed); cache it after "
                    "the step that writes it"
                )
            key = keys.get(block_id)
            if key is not None and key != (group_id, h):
                raise ValueError(
                    f"block {block_id} is already cached under another hash (group {key[0]}); "
                    "a block's contents are fixed once it is full: cache each block once"
                )
        for h, block_id in zip(hashes, ids):
            self._cache.add(group_id, h, block_id)

    def take_new_blocks(self) -> list[int]:
        """Ids handed out by ``allocate`` since the last call and still held, each once.

        A block freed before this call is left out: it is zeroed when it is
        next allocated. Cache hits are never reported.
        """
        new, self._new = self._new, []
        if not self._caching:
            held = self._held
            return [b for b in dict.fromkeys(new) if held[b]]
        pending = self._pending
        out = [b for b in dict.fromkeys(new) if pending[b]]
        for b in out:
            pending[b] = 0
        return out

    def requeue_new_blocks(self, block_ids: Sequence[int]) -> None:
        """Put ids that :meth:`take_new_blocks` returned back in front of the pending list.

        For a caller whose zeroing failed after the take: the blocks stay
        pending, so the next :meth:`take_new_blocks` reports them again
        (those freed in between are left out, as always).
        """
        ids = [as_int("block id", b) for b in block_ids]
        for block_id in ids:
            self._check_id(block_id)
        if self._caching:
            for block_id in ids:
                if self._refs[block_id] > 0:
                    self._pending[block_id] = 1
        self._new[:0] = ids

    def resize(self, num_blocks: int) -> None:
        """Grow or shrink the pool to ids ``1 .. num_blocks - 1``, all or nothing.

        Growing appends the new ids to the free list (they count as new when
        handed out). Shrinking refuses, naming them, while ids at or above
        ``num_blocks`` are held; evictable cached blocks there are evicted
        (their hashes stop hitting) and free ones dropped.
        """
        num_blocks = as_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        old = self._num_blocks
        if num_blocks < old:
            held = [b for b in range(num_blocks, old) if self.is_allocated(b)]
            if held:
                shown = ", ".join(map(str, held[:8])) + (", ..." if len(held) > 8 else "")
                raise ValueError(
                    f"cannot shrink the pool to {num_blocks} blocks: {len(held)} block(s) at or above "
                    f"{num_blocks} are held ({shown}); free them first or shrink less"
                )
            for block_id in [b for b in self._cache.evictable if b >= num_blocks]:
                del self._cache.evictable[block_id]
                self._cache.drop(block_id)
            self._free = deque(b for b in self._free if b < num_blocks)
            self._new = [b for b in self._new if b < num_blocks]
            del self._held[num_blocks:]
            del self._pending[num_blocks:]
            del self._refs[num_blocks:]
        else:
            self._free.extend(range(old, num_blocks))
            if self._caching:
                self._refs.extend([0] * (num_blocks - old))
                self._pending.extend(bytes(num_blocks - old))
            else:
                self._held.extend(bytes(num_blocks - old))
        self._num_blocks = num_blocks

    def _check_id(self, block_id: int) -> int:
        block_id = as_int("block id", block_id)
        if block_id == NULL_BLOCK_ID:
            raise ValueError(
                f"block {NULL_BLOCK_ID} is the reserved null block and is never "
                "allocated; drop it from the ids (e.g. padding in a block table)"
            )
        if not 0 < block_id < self._num_blocks:
            raise ValueError(
                f"block id {block_id} is outside this pool of {self._num_blocks} "
                f"blocks; valid ids are 1..{self._num_blocks - 1}"
            )
        return block_id

    def __repr__(self) -> str:
        cached = f", cached={len(self._cache)}" if self._caching else ""
        return f"BlockPool(num_blocks={self._num_blocks}, free={self.num_free_blocks}{cached})"
