"""Chained block hashes (128-bit XXH3, equal on every machine) that name a block's contents;
XXH3 is not cryptographic: users who do not trust each other need a per-tenant extra key."""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

import xxhash

from kvcore._validate import as_int, positive_int

#: Leads every hashed payload; bump the version if the encoding ever changes.
_DOMAIN = b"kvcore.block-hash/1"
_U32 = struct.Struct("<I")
#: Where the least significant byte of a native uint64 sits.
_LOW_BYTE = 0 if sys.byteorder == "little" else 7

ExtraKey = int | str | bytes


def _encode_extra_keys(extra_keys: ExtraKey | Iterable[ExtraKey] | None) -> bytes:
    if isinstance(extra_keys, (int, str, bytes)):
        extra_keys = [extra_keys]  # NOTE: one key; a bool is refused below
    elif extra_keys is not None and not isinstance(extra_keys, Iterable):
        raise TypeError(f"extra_keys must be None, one int/str/bytes key or a sequence of them, got {extra_keys!r}")
    keys = [] if extra_keys is None else list(extra_keys)
    parts = [_U32.pack(len(keys))]
    for i, key in enumerate(keys):
        if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
            raise TypeError(f"extra_keys[{i}] must be an int, str or bytes (e.g. a LoRA "
                            f"id or an image hash), got {key!r} ({type(key).__name__})")
        if isinstance(key, int):
            tag, payload = b"i", key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
        elif isinstance(key, str):
            tag, payload = b"s", key.encode("utf-8")
        else:
            tag, payload = b"b", key
        parts.append(tag + _U32.pack(len(payload)) + payload)
    return b"".join(parts)


def _token_array(token_ids: Sequence[int]) -> array:
    """The ids as little-endian uint64, each checked to be an int in [0, 2**64)."""
    if isinstance(token_ids, (list, tuple)):
        ids = token_ids
    elif hasattr(token_ids, "tolist"):  # NOTE: torch tensors and numpy arrays, in one C call
        ids = token_ids.tolist()
        if not isinstance(ids, list):
            raise TypeError(f"token_ids must be one-dimensional, got the scalar {token_ids!r}")
    else:
        ids = list(token_ids)
    try:
        tokens = array("Q", ids)  # NOTE: refuses non-integers and ids outside [0, 2**64) in C
    except (TypeError, OverflowError):
        for i, t in enumerate(ids):  # name the offending id
            if not 0 <= as_int(f"token_ids[{i}]", t) < 2**64:
                raise ValueError(f"token_ids[{i}] = {t} is not a token id; ids must be in [0, 2**64)") from None
        tokens = array("Q", [as_int("token id", t) for t in ids])  # other int-like values
    # NOTE: array takes a bool as 0 or 1; only ids whose low byte is 0 or 1 are looked at.
    low = tokens.tobytes()[_LOW_BYTE::8]
    for byte in (b"\x00", b"\x01"):
        i = low.find(byte)
        while i != -1:
            if type(ids[i]) is bool:
                raise TypeError(f"token_ids[{i}] is the bool {ids[i]!r}, not a token id; pass "
                                "integer ids (int(x), or tensor.long() for a bool tensor)")
            i = low.find(byte, i + 1)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def block_hashes(token_ids: Sequence[int], block_size: int, *, extra_keys: ExtraKey | Iterable[ExtraKey] | None = None,
                 parent: bytes | None = None) -> list[bytes]:
    """One chained 16-byte hash per full block of ``token_ids``; a partial last block gets none.

    Block ``i``'s hash covers its tokens, block ``i - 1``'s hash (``parent`` for block 0)
    and ``extra_keys`` (an int, str or bytes, or a sequence of them: a LoRA id, a salt).
    """
    block_size = positive_int("block_size", block_size)
    if parent is not None and (type(parent) is not bytes or not parent):
        raise TypeError(f"parent must be None or a non-empty bytes hash from block_hashes, got {parent!r}")
    tail = _encode_extra_keys(extra_keys) + _U32.pack(block_size)
    tokens = _token_array(token_ids)
    raw, step = memoryview(tokens).cast("B"), 8 * block_size
    digest, join, pack = xxhash.xxh3_128_digest, b"".join, _U32.pack
    out, prev = [], parent or b""
    for start in range(0, (len(tokens) // block_size) * step, step):
        prev = digest(join((_DOMAIN, pack(len(prev)), prev, tail, raw[start : start + step])))
        out.append(prev)
    return out


def sliding_window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding-window group needs cached for a hit: ``ceil((window - 1) / block_size)``.

    The next token attends itself and the ``sliding_window - 1`` tokens before it (at least 1).
    """
    tokens = positive_int("sliding_window", sliding_window) - 1
    return max(1, -(-tokens // positive_int("block_size", block_size)))
