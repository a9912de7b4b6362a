"""The pool of manager block ids a scheduler hands to sequences, with an optional prefix cache;
block 0 is the null block, never handed out, so a block table can use it as padding."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence

from kvcore._validate import as_int, non_negative_int, positive_int
from kvcore.errors import OutOfBlocksError
from kvcore.memory.config import MAX_NUM_BLOCKS

NULL_BLOCK_ID = 0


def _checked_size(num_blocks: int) -> int:
    num_blocks = positive_int("num_blocks", num_blocks)
    if num_blocks < 2:
        raise ValueError(f"a block pool needs at least 2 blocks (block {NULL_BLOCK_ID} is the "
                         f"reserved null block), got num_blocks={num_blocks}; plan more blocks")
    if num_blocks > MAX_NUM_BLOCKS:
        raise ValueError(f"num_blocks={num_blocks:,} is more than the {MAX_NUM_BLOCKS:,} blocks "
                         "a BlockPool manages (its host bookkeeping takes about 50 bytes a "
                         "block); use larger blocks (a bigger block_size) or plan fewer of them")
    return num_blocks


def _hashes(hashes: Sequence[bytes]) -> list[bytes]:
    if isinstance(hashes, (bytes, bytearray, str)):
        raise TypeError("hashes must be a list of block hashes (bytes), not one value; wrap it: [h]")
    out = list(hashes)
    for i, h in enumerate(out):
        if type(h) is not bytes or not h:
            raise TypeError(f"hashes[{i}] must be non-empty bytes from kvcore.block_hashes, got {h!r} "
                            f"({type(h).__name__}); a partial block has no hash and cannot be cached")
    return out


class BlockPool:
    """Free list of block ids ``1 .. num_blocks - 1``, optionally with a prefix cache.

    O(1) per block. ``allocate`` takes free blocks first (first freed, first reused), then
    evicts the least recently freed cached block. With ``enable_caching=True`` each KV cache
    group caches full, written blocks under their :func:`kvcore.block_hashes`.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False) -> None:
        num_blocks = _checked_size(num_blocks)
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be True or False, got {enable_caching!r}")
        self._caching = enable_caching
        self._free = deque(range(1, num_blocks))
        # NOTE: _refs[b] counts b's holders (at most 1 without caching); _to_zero holds the
        # blocks allocated and still held that take_new_blocks has not reported yet.
        self._refs = [0] * num_blocks
        self._to_zero: dict[int, None] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._maps: dict[int, dict[bytes, int]] = {}  # group id -> hash -> block
        self._keys: dict[int, tuple[int, bytes]] = {}  # block -> (group id, hash)

    @property
    def num_blocks(self) -> int:
        """All blocks, the null block included."""
        return len(self._refs)

    @property
    def enable_caching(self) -> bool:
        """Whether this pool keeps a prefix cache (fixed when it is built)."""
        return self._caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: free plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one reference."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks recorded in the prefix cache (held or evictable)."""
        return len(self._keys)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds, kept until ``allocate`` needs them."""
        return len(self._evictable)

    def is_allocated(self, block_id: int) -> bool:
        block_id = as_int("block_id", block_id)
        return 0 <= block_id < self.num_blocks and self._refs[block_id] > 0

    def ref_count(self, block_id: int) -> int:
        """How many holders share ``block_id`` (0 when free; at most 1 without caching)."""
        return self._refs[self._check_id(block_id)]

    def block_hash(self, block_id: int) -> tuple[int, bytes] | None:
        """``(group_id, hash)`` the block is cached under, or None."""
        return self._keys.get(self._check_id(block_id))

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` block ids, or none at all (:class:`OutOfBlocksError`)."""
        n = non_negative_int("number of blocks to allocate", n)
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks)
        ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(ids) < n:  # NOTE: then the least recently freed cached blocks
            block_id = self._evictable.popitem(last=False)[0]
            self._drop(block_id)
            ids.append(block_id)
        for block_id in ids:
            self._refs[block_id] = 1
            self._to_zero[block_id] = None
        return ids

    def free(self, block_ids: Iterable[int] | int) -> None:
        """Drop one reference to each block (one id or an iterable of ids), all or nothing.

        A cached block whose last reference goes becomes evictable, in the order given (free
        a request's blocks last first: its tail is evicted before its shared head).
        """
        # NOTE: a 0-d tensor or array is one id, though it is Iterable (and iterating it raises).
        if isinstance(block_ids, Iterable) and getattr(block_ids, "ndim", 1) != 0:
            ids = [self._check_id(b) for b in block_ids]
        else:
            ids = [self._check_id(block_ids)]
        refs = self._refs
        for block_id, count in Counter(ids).items():
            if refs[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated (double free?); "
                                 "free each allocated block once per reference")
            if count > refs[block_id]:
                times = "twice" if count == 2 else f"{count} times"
                raise ValueError(f"block {block_id} appears {times} in one free() call but has only "
                                 f"{refs[block_id]} reference(s) (double free?); free it once per holder")
        for block_id in ids:
            refs[block_id] -= 1
            if refs[block_id] == 0:
                if block_id in self._to_zero:  # NOTE: not zeroed (maybe requeued): not cached
                    del self._to_zero[block_id]
                    self._drop(block_id)
                if block_id in self._keys:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def find_cached_prefix(self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None) -> int:
        """How many leading blocks of ``hashes`` a hit would cover; changes nothing.

        ``window=None``: every block of the prefix must be cached. With ``window=w``
        (:func:`kvcore.sliding_window_blocks`) only the last ``w`` blocks of the prefix must be
        cached. Without caching: 0.
        """
        return self._hit_range(_hashes(hashes), group_id, window)[1]

    def find_common_prefix(self, groups: Mapping[int, tuple[Sequence[bytes], int, int | None]], *,
                           max_tokens: int | None = None) -> int:
        """Tokens of the longest prefix every group hits (a multiple of each block size).

        ``groups[group_id] = (hashes, block_size, window)``; ``max_tokens`` caps the hit.
        """
        checked = []
        for group_id, entry in groups.items():
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise TypeError(f"groups[{group_id!r}] must be (hashes, block_size, "
                                f"window), got {entry!r}; window is None for full attention")
            block_size = positive_int("block_size", entry[1])
            checked.append((group_id, _hashes(entry[0]), block_size, entry[2]))
        limit = min((len(h) * bs for _, h, bs, _ in checked), default=0)
        if max_tokens is not None:
            limit = min(limit, non_negative_int("max_tokens", max_tokens))
        changed = True
        while changed:  # NOTE: a sliding window's hit may shrink; repeat until all agree
            changed = False
            for group_id, hashes, block_size, window in checked:
                blocks = self._hit_range(hashes[: limit // block_size], group_id, window)[1]
                if blocks * block_size < limit:
                    limit, changed = blocks * block_size, True
        return limit

    def get_cached_blocks(self, hashes: Sequence[bytes], *, group_id: int = 0, window: int | None = None) -> list[int]:
        """The blocks of the prefix :meth:`find_cached_prefix` measures; each gains a reference.

        With a ``window``, positions before it hold ``NULL_BLOCK_ID`` and take no reference.
        Hits are shared: never reported by :meth:`take_new_blocks`, never zeroed.
        """
        hashes = _hashes(hashes)
        group_id = non_negative_int("group_id", group_id)
        start, end = self._hit_range(hashes, group_id, window)
        if end == 0:
            return []
        ids = [self._maps[group_id][h] for h in hashes[start:end]]
        for block_id in ids:
            if self._refs[block_id] == 0:
                del self._evictable[block_id]
            self._refs[block_id] += 1
        return [NULL_BLOCK_ID] * start + ids

    def cache_blocks(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, group_id: int = 0) -> None:
        """Record held, full, written blocks under their hashes (``hashes[i]``: ``block_ids[i]``).

        Call it once a block is full and the step writing it has begun. A hash the group
        already caches keeps its first block. All or nothing.
        """
        if not self._caching:
            raise ValueError("this BlockPool was built without prefix caching; pass enable_caching=True")
        hashes = _hashes(hashes)
        ids = [self._check_id(b) for b in block_ids]
        group_id = non_negative_int("group_id", group_id)
        if len(hashes) != len(ids):
            raise ValueError(f"cache_blocks got {len(hashes)} hashes for {len(ids)} block ids; give one hash per "
                             "block (block_hashes hashes full blocks only: a partial last block cannot be cached)")
        if len(set(ids)) != len(ids):
            raise ValueError(f"cache_blocks got a block id twice in {ids}; list each block once")
        for h, block_id in zip(hashes, ids):
            if self._refs[block_id] == 0:
                raise ValueError(f"block {block_id} is not allocated; cache only "
                                 "blocks you hold, once their contents are written")
            if block_id in self._to_zero:
                raise ValueError(f"block {block_id} was allocated but no step has been handed it "
                                 "yet (take_new_blocks / KVCache.begin_step has not reported it, so "
                                 "it is still to be zeroed); cache it after the step that writes it")
            if self._keys.get(block_id, (group_id, h)) != (group_id, h):
                raise ValueError(f"block {block_id} is already cached under another hash "
                                 f"(group {self._keys[block_id][0]}); a block's contents "
                                 "are fixed once it is full: cache each block once")
        cache = self._maps.setdefault(group_id, {})
        for h, block_id in zip(hashes, ids):
            if h not in cache:
                cache[h] = block_id
                self._keys[block_id] = (group_id, h)

    def take_new_blocks(self) -> list[int]:
        """The blocks to zero: ids ``allocate`` handed out since the last call and still held."""
        new, self._to_zero = list(self._to_zero), {}
        return new

    def requeue_new_blocks(self, block_ids: Sequence[int]) -> None:
        """Report ids :meth:`take_new_blocks` returned again at its next call (zeroing failed)."""
        ids = [self._check_id(b) for b in block_ids]
        self._to_zero = {**dict.fromkeys(b for b in ids if self._refs[b] > 0), **self._to_zero}

    def resize(self, num_blocks: int) -> None:
        """Grow or shrink to ids ``1 .. num_blocks - 1``; refused while ids above are held."""
        num_blocks = _checked_size(num_blocks)
        old = self.num_blocks
        held = [b for b in range(num_blocks, old) if self._refs[b]]
        if held:
            shown = ", ".join(map(str, held[:8])) + (", ..." if len(held) > 8 else "")
            raise ValueError(f"cannot shrink the pool to {num_blocks} blocks: {len(held)} block(s) at "
                             f"or above {num_blocks} are held ({shown}); free them first or shrink less")
        for block_id in [b for b in self._evictable if b >= num_blocks]:
            del self._evictable[block_id]
            self._drop(block_id)
        self._free = deque(b for b in self._free if b < num_blocks)
        self._free.extend(range(old, num_blocks))
        if num_blocks > old:
            self._refs.extend([0] * (num_blocks - old))
        else:
            del self._refs[num_blocks:]

    def _hit_range(self, hashes: list[bytes], group_id: int, window: int | None) -> tuple[int, int]:
        """``(start, end)``: the hit is ``hashes[:end]``; only ``hashes[start:end]`` are needed."""
        group_id = non_negative_int("group_id", group_id)
        if window is not None:
            window = positive_int("window (blocks)", window)
        cache = self._maps.get(group_id, {})
        if window is None:
            end = 0
            while end < len(hashes) and hashes[end] in cache:
                end += 1
            return 0, end
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            run = run + 1 if hashes[i] in cache else 0
            if run == window:
                return i, i + window
        return 0, run  # NOTE: the leading blocks are all cached, fewer than the window

    def _drop(self, block_id: int) -> None:
        key = self._keys.pop(block_id, None)
        if key is not None:
            del self._maps[key[0]][key[1]]

    def _check_id(self, block_id: int) -> int:
        block_id = as_int("block id", block_id)
        if block_id == NULL_BLOCK_ID:
            raise ValueError(f"block {NULL_BLOCK_ID} is the reserved null block and is never "
                             "allocated; drop it from the ids (e.g. padding in a block table)")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside this pool of {self.num_blocks} "
                             f"blocks; valid ids are 1..{self.num_blocks - 1}")
        return block_id

    def __repr__(self) -> str:
        cached = f", cached={len(self._keys)}" if self._caching else ""
        return f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free_blocks}{cached})"
