"""Block zeroing: clear newly allocated KV cache blocks in one kernel launch."""

from kvcore.runtime.zeroer.zeroer import KVBlockZeroer

__all__ = ["KVBlockZeroer"]
