"""The prefix cache inside a caching ``BlockPool``: which block holds which hash, per group.

Each KV cache group has its own map from block hash to block id (block ids are
global, so one pool serves every group, but a group's hash says nothing about
another group's layers). Cached blocks that nobody holds are evictable and
kept in an ordered dict, least recently freed first. Every operation is O(1)
per block. Which blocks a group may cache is the engine's choice:
- full attention: every full block;
- sliding window: every full block; a hit needs only the blocks inside the
  window (``window=``), so blocks that slid out may be evicted freely;
- state caches (Mamba): nothing, unless the engine keeps the state exactly as
  it was at a block boundary in that block; a running state overwritten each
  step stands for no fixed prefix and must never be cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvcore._validate import non_negative_int, positive_int

#: ``(group_id, hashes, block_size, window)`` of one KV cache group in a hit lookup.
GroupQuery = tuple[int, list[bytes], int, "int | None"]


def check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    """``hashes`` as a list, each non-empty bytes (what :func:`kvcore.block_hashes` returns)."""
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


def check_window(window: int | None) -> int | None:
    return None if window is None else positive_int("window (blocks)", window)


def check_groups(groups: Mapping[int, tuple[Sequence[bytes], int, int | None]]) -> list[GroupQuery]:
    """``{group_id: (hashes, block_size, window)}`` checked, as a list of :data:`GroupQuery`."""
    checked = []
    for group_id, entry in groups.items():
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise TypeError(
                f"groups[{group_id!r}] must be (hashes, block_size, window), got {entry!r}; "
                "window is None for full attention"
            )
        hashes, block_size, window = entry
        checked.append((non_negative_int("group_id", group_id), check_hashes(hashes),
                        positive_int("block_size", block_size), check_window(window)))  # fmt: skip
    return checked


class PrefixCache:
    """Hash → block maps per group, the key of each cached block, and the evictable blocks."""

    def __init__(self) -> None:
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self._maps: dict[int, dict[bytes, int]] = {}
        self.keys: dict[int, tuple[int, bytes]] = {}  # block id -> (group id, hash)

    def __len__(self) -> int:
        return len(self.keys)

    def key_of(self, block_id: int) -> tuple[int, bytes] | None:
        return self.keys.get(block_id)

    def hit_range(self, hashes: Sequence[bytes], group_id: int, window: int | None) -> tuple[int, int]:
        """``(start, end)``: the longest hit is ``hashes[:end]``; only ``hashes[start:end]`` are needed."""
        cache = self._maps.get(group_id)
        if not cache:
            return 0, 0
        if window is None:
            end = 0
            for h in hashes:
                if h not in cache:
                    break
                end += 1
            return 0, end
        run = 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in cache:
                run += 1
                if run == window:
                    return i, i + window
            else:
                run = 0
        return 0, run  # the leading blocks are all cached, fewer than the window

    def common_prefix(self, groups: list[GroupQuery], limit: int) -> int:
        """Longest prefix, at most ``limit`` tokens, that every ``(group_id, hashes, block_size, window)`` hits."""
        changed = True
        while changed and limit:  # NOTE: a sliding window's hit may shrink; repeat until all agree
            changed = False
            for group_id, hashes, block_size, window in groups:
                hit = self.hit_range(hashes[: limit // block_size], group_id, window)[1] * block_size
                if hit < limit:
                    limit, changed = hit, True
        return limit

    def blocks(self, hashes: Sequence[bytes], group_id: int) -> list[int]:
        cache = self._maps[group_id]
        return [cache[h] for h in hashes]

    def add(self, group_id: int, block_hash: bytes, block_id: int) -> None:
        """Record ``block_id`` unless the group already caches ``block_hash`` (first block wins)."""
        cache = self._maps.setdefault(group_id, {})
        if block_hash not in cache:
            cache[block_hash] = block_id
            self.keys[block_id] = (group_id, block_hash)

    def drop(self, block_id: int) -> None:
        """Forget ``block_id``'s hash (it must not be evictable)."""
        key = self.keys.pop(block_id, None)
        if key is not None:
            del self._maps[key[0]][key[1]]

    def evict_oldest(self) -> int:
        """Remove the least recently freed evictable block from the cache and return it."""
        block_id = self.evictable.popitem(last=False)[0]
        group_id, block_hash = self.keys.pop(block_id)
        del self._maps[group_id][block_hash]
        return block_id
