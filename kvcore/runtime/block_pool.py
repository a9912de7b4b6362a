"""The pool of manager block ids a scheduler hands to sequences, with an optional prefix cache.

Block 0 is the null block: it is never handed out, so a block table can use
it as padding (or for blocks a sliding window no longer needs) and kernels
reading it read memory no live sequence owns.

With ``enable_caching=True`` a full block whose contents are written can be
recorded under its chained hash (:func:`kvcore.block_hashes`). Later requests
with the same prefix share it instead of recomputing it: every holder keeps a
reference, and a cached block whose last reference is dropped stays cached
(evictable) until ``allocate`` runs out of plain free blocks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from kvcore._validate import as_int, non_negative_int, positive_int
from kvcore.errors import OutOfBlocksError

NULL_BLOCK_ID = 0


def _check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    if isinstance(hashes, (bytes, bytearray, str)):
        raise TypeError("hashes must be a list of block hashes (bytes), not one value; wrap it: [h]")
    out = list(hashes)
    for i, h in enumerate(out):
        if type(h) is not bytes or not h:
            raise TypeError(
                f"hashes[{i}] must be non-empty bytes from kvcore.block_hashes, got {h!r} "
                f"({type(h).__name__}); a partial block has no hash and cannot be cached"
            )
    return out


class BlockPool:
    """Free list of block ids ``1 .. num_blocks - 1``, optionally with a prefix cache.

    Without caching, ``allocate`` and ``free`` cost O(1) per block (a deque of
    free ids and a bytearray marking ids in use) and ids come back in
    first-freed, first-reused order.

    With caching, every block has a reference count. Free blocks are of two
    kinds: plain (no cached contents) and evictable (cached, no holder, kept
    least recently freed first). ``allocate`` takes plain blocks first and
    evicts only when none is left; an evicted block loses its hash. Each KV
    cache group has its own cache (``group_id``): block ids are global, so
    one pool serves every group, and a hash cached in group 0 never hits in
    group 1. Allocate, free, hit and evict are O(1) per block.

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
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be True or False, got {enable_caching!r}")
        self._num_blocks = num_blocks
        self._caching = enable_caching
        self._free: deque[int] = deque(range(1, num_blocks))
        # Caching off: 1 = in use. Caching on: 1 = handed out by allocate and not yet reported.
        self._in_use = bytearray(num_blocks)
        self._new: list[int] = []
        self._refs = [0] * num_blocks if enable_caching else []
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._caches: dict[int, dict[bytes, int]] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}

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
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one reference."""
        return self._num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks recorded in the prefix cache (held or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds, kept until ``allocate`` needs them."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks in use (0.0 .. 1.0)."""
        return self.num_used_blocks / (self._num_blocks - 1)

    def is_allocated(self, block_id: int) -> bool:
        block_id = as_int("block_id", block_id)
        if not 0 <= block_id < self._num_blocks:
            return False
        return self._refs[block_id] > 0 if self._caching else bool(self._in_use[block_id])

    def ref_count(self, block_id: int) -> int:
        """How many holders share ``block_id`` (0 when free; at most 1 without caching)."""
        block_id = self._check_id(block_id)
        return self._refs[block_id] if self._caching else int(self._in_use[block_id])

    def block_hash(self, block_id: int) -> tuple[int, bytes] | None:
        """``(group_id, hash)`` the block is cached under, or None."""
        return self._key_of.get(self._check_id(block_id))

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` block ids, or none at all.

        With caching, plain free blocks go first; then the least recently
        freed evictable blocks are evicted (their hashes stop hitting).

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
                self._in_use[block_id] = 1
            self._new.extend(ids)
            return ids
        if n > len(free) + len(self._evictable):
            raise OutOfBlocksError(n, len(free) + len(self._evictable))
        take = min(n, len(free))
        ids = [free.popleft() for _ in range(take)]
        if take < n:
            popitem, key_of, caches = self._evictable.popitem, self._key_of, self._caches
            for _ in range(n - take):
                block_id = popitem(last=False)[0]
                group_id, h = key_of.pop(block_id)
                del caches[group_id][h]  # evicted: its hash no longer hits
                ids.append(block_id)
        refs, pending = self._refs, self._in_use
        for block_id in ids:
            refs[block_id] = 1
            pending[block_id] = 1
        self._new.extend(ids)
        return ids

    def free(self, block_ids: Iterable[int] | int) -> None:
        """Drop one reference to each block (one id or an iterable of ids).

        Without caching a freed block is plain free again. With caching a
        block whose last reference goes becomes evictable if it is cached
        (in the order given: free a request's blocks last block first so its
        tail is evicted before its shared head) and plain free otherwise. A
        block freed before :meth:`take_new_blocks` reported it was never
        zeroed nor written by a step: it loses its hash and is plain free.
        Every id is checked before any is freed: the null block, ids outside
        the pool, ids not allocated (double frees) and ids repeated within the
        call more often than they are held raise ``ValueError`` and leave the
        pool unchanged.
        """
        if isinstance(block_ids, Iterable):
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
                if not self._in_use[block_id]:
                    raise ValueError(
                        f"block {block_id} is not allocated (double free?); free each "
                        "allocated block exactly once"
                    )
                seen.add(block_id)
            for block_id in ids:
                self._in_use[block_id] = 0
            self._free.extend(ids)
            return
        refs = self._refs
        counts = Counter(ids) if len(ids) > 1 else {b: 1 for b in ids}
        for block_id, count in counts.items():
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
        pending, key_of = self._in_use, self._key_of
        for block_id in ids:
            left = refs[block_id] - 1
            refs[block_id] = left
            if left == 0:
                if pending[block_id]:
                    # NOTE: never reported for zeroing, so no step wrote it: forget its hash.
                    pending[block_id] = 0
                    self._uncache(block_id)
                if block_id in key_of:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def find_cached_prefix(
        self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None
    ) -> int:
        """How many leading blocks of ``hashes`` a cache hit would cover; changes nothing.

        ``window=None`` (full attention): the longest prefix whose blocks are
        all cached. ``window=w`` (sliding window, ``w`` blocks, see
        :func:`kvcore.sliding_window_blocks`): the longest prefix whose last
        ``w`` blocks are cached (all of it when shorter than ``w``); blocks
        before those are not needed. Without caching: always 0.
        """
        hashes = _check_hashes(hashes)
        group_id = non_negative_int("group_id", group_id)
        if window is not None:
            window = positive_int("window (blocks)", window)
        cache = self._caches.get(group_id)
        if not self._caching or not cache:
            return 0
        if window is None:
            n = 0
            for h in hashes:
                if h not in cache:
                    break
                n += 1
            return n
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in cache:
                run += 1
                if run == window:
                    return i + window
            else:
                run = 0
        return run  # the leading blocks are all cached but fewer than the window

    def get_cached_blocks(
        self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None
    ) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``; each gains a reference.

        The prefix is the one :meth:`find_cached_prefix` measures. With a
        ``window``, positions before the window's blocks hold
        ``NULL_BLOCK_ID`` (0): they take no reference; leave them out of
        :meth:`free`. Hit blocks are shared, never new: they are not reported
        by :meth:`take_new_blocks` and must not be zeroed or written.
        """
        n = self.find_cached_prefix(hashes, group_id=group_id, window=window)
        if n == 0:
            return []
        cache, refs, evictable = self._caches[group_id], self._refs, self._evictable
        start = 0 if window is None else max(0, n - window)
        ids = [NULL_BLOCK_ID] * start
        for h in hashes[start:n]:
            block_id = cache[h]
            if refs[block_id] == 0:
                del evictable[block_id]
            refs[block_id] += 1
            ids.append(block_id)
        return ids

    def cache_blocks(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, group_id: int = 0) -> None:
        """Record held, full, written blocks under their hashes: ``hashes[i]`` is ``block_ids[i]``'s.

        A block already cached under the same key is left as it is (callers
        may re-cache a request's whole prefix every step). A hash the group
        already caches in another block keeps that block; this block stays
        uncached. Refused, pool unchanged: caching off, lists of different
        lengths (a partial block has no hash), ids not allocated or repeated,
        a block cached under another hash or group.
        """
        if not self._caching:
            raise ValueError("this BlockPool was built without prefix caching; pass enable_caching=True")
        hashes = _check_hashes(hashes)
        ids = [as_int("block id", b) for b in block_ids]
        group_id = non_negative_int("group_id", group_id)
        if len(hashes) != len(ids):
            raise ValueError(
                f"cache_blocks got {len(hashes)} hashes for {len(ids)} block ids; give one hash per "
                "block (block_hashes hashes full blocks only: a partial last block cannot be cached)"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"cache_blocks got a block id twice in {ids}; list each block once")
        for h, block_id in zip(hashes, ids):
            self._check_id(block_id)
            if self._refs[block_id] == 0:
                raise ValueError(
                    f"block {block_id} is not allocated; cache only blocks you hold, "
                    "after their contents are written"
                )
            key = self._key_of.get(block_id)
            if key is not None and key != (group_id, h):
                raise ValueError(
                    f"block {block_id} is already cached under another hash (group {key[0]}); "
                    "a block's contents are fixed once it is full: cache each block once"
                )
        cache = self._caches.setdefault(group_id, {})
        for h, block_id in zip(hashes, ids):
            if h not in cache:
                cache[h] = block_id
                self._key_of[block_id] = (group_id, h)

    def take_new_blocks(self) -> list[int]:
        """Ids handed out by ``allocate`` since the last call and still held, each once.

        A block freed before this call is left out: it is zeroed when it is
        next allocated. Cache hits are never reported.
        """
        new, self._new = self._new, []
        pending = self._in_use
        out = [b for b in dict.fromkeys(new) if pending[b]]
        if self._caching:
            for b in out:
                pending[b] = 0
        return out

    def _uncache(self, block_id: int) -> None:
        key = self._key_of.pop(block_id, None)
        if key is not None:
            del self._caches[key[0]][key[1]]

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
        cached = f", cached={len(self._key_of)}" if self._caching else ""
        return f"BlockPool(num_blocks={self._num_blocks}, free={self.num_free_blocks}{cached})"
