"""Chained block hashes that name a KV block's contents for the prefix cache.

A block's hash covers its tokens, its parent's hash (so it names the whole
prefix up to its end) and extra keys (a LoRA id, a multimodal input's hash, a
tenant salt). The hash is 128-bit XXH3 (``xxhash``) over a canonical,
length-prefixed and typed byte encoding: equal inputs give equal hashes in
every process and on every machine, and distinct inputs cannot encode alike.
XXH3 is fast, not cryptographic: a server whose users do not trust each other
should give each tenant its own extra key so that no one can craft a
collision with another tenant's blocks.
"""

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
_MAX_TOKEN = 2**64 - 1

ExtraKey = int | str | bytes


def _encode_key(i: int, key: object) -> bytes:
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(
            f"extra_keys[{i}] must be an int, str or bytes (e.g. a LoRA id or an image "
            f"hash), got {key!r} ({type(key).__name__})"
        )
    if isinstance(key, int):
        tag, payload = b"i", key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
    elif isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    else:
        tag, payload = b"b", key
    return tag + _U32.pack(len(payload)) + payload


def _encode_extra_keys(extra_keys: ExtraKey | Iterable[ExtraKey] | None) -> bytes:
    if extra_keys is None:
        keys: list[object] = []
    elif isinstance(extra_keys, (int, str, bytes)):
        keys = [extra_keys]  # one key; bools are refused in _encode_key
    elif isinstance(extra_keys, Iterable):
        keys = list(extra_keys)
    else:
        raise TypeError(
            f"extra_keys must be None, one int/str/bytes key or a sequence of them, got {extra_keys!r}"
        )
    return _U32.pack(len(keys)) + b"".join(_encode_key(i, k) for i, k in enumerate(keys))


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
        tokens = None
    if tokens is None:  # slow path: name the offending id, or accept other int-like values
        checked = []
        for i, t in enumerate(ids):
            t = as_int(f"token_ids[{i}]", t)
            if not 0 <= t <= _MAX_TOKEN:
                raise ValueError(f"token_ids[{i}] = {t} is not a token id; ids must be in [0, 2**64)")
            checked.append(t)
        tokens = array("Q", checked)
    else:
        _refuse_bools(ids, tokens)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


#: Where the least significant byte of a native uint64 sits.
_LOW_BYTE = 0 if sys.byteorder == "little" else 7


def _refuse_bools(ids: Sequence[object], tokens: array) -> None:
    """``TypeError`` for a bool among ``ids`` (``array`` took it as 0 or 1), as the pool refuses them.

    Only ids whose low byte is 0 or 1 can be bools: they are found by byte
    searches in C, and only those few are looked at in Python.
    """
    low = tokens.tobytes()[_LOW_BYTE::8]
    for byte in (b"\x00", b"\x01"):
        i = low.find(byte)
        while i != -1:
            if type(ids[i]) is bool:
                raise TypeError(
                    f"token_ids[{i}] is the bool {ids[i]!r}, not a token id; pass integer ids "
                    "(int(x), or tensor.long() for a bool tensor)"
                )
            i = low.find(byte, i + 1)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys: ExtraKey | Iterable[ExtraKey] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """One chained 16-byte hash per full block of ``token_ids``; a partial last block gets none.

    Block ``i``'s hash covers its ``block_size`` tokens, block ``i - 1``'s hash
    (``parent`` for block 0: the hash of the block before ``token_ids[0]``,
    None at the start of a sequence) and ``extra_keys`` (one int, str or
    bytes, or a sequence of them, applied to every block). To key only the
    blocks from some point on (say, from the block holding an image), hash
    the sequence in two calls split at a block boundary and pass the first
    call's last hash as the second call's ``parent``: the result equals one
    call's wherever the keys agree.

    :raises TypeError: a token id, ``block_size``, key or ``parent`` of the wrong type.
    :raises ValueError: a negative token id or a non-positive ``block_size``.
    """
    block_size = positive_int("block_size", block_size)
    if parent is not None and (type(parent) is not bytes or not parent):
        raise TypeError(
            f"parent must be None or a non-empty bytes hash from block_hashes, got {parent!r}"
        )
    keys = _encode_extra_keys(extra_keys)
    tokens = _token_array(token_ids)
    raw = memoryview(tokens).cast("B")
    step = 8 * block_size
    tail = keys + _U32.pack(block_size)
    digest, join, pack = xxhash.xxh3_128_digest, b"".join, _U32.pack
    out: list[bytes] = []
    prev = parent or b""
    for start in range(0, (len(tokens) // block_size) * step, step):
        prev = digest(join((_DOMAIN, pack(len(prev)), prev, tail, raw[start : start + step])))
        out.append(prev)
    return out


def sliding_window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks a sliding-window group needs cached for a hit: the window before the next token.

    The next token attends itself and the ``sliding_window - 1`` tokens before
    it; with the prefix ending at a block boundary those tokens span
    ``ceil((sliding_window - 1) / block_size)`` blocks (at least 1). Pass the
    result as ``window=`` to :meth:`BlockPool.get_cached_blocks`.
    """
    sliding_window = positive_int("sliding_window", sliding_window)
    block_size = positive_int("block_size", block_size)
    return max(1, -(-(sliding_window - 1) // block_size))
