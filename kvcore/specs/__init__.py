"""KV cache specs: what one layer stores per block.

A spec describes one layer's cache in the logical shape ``[B, H, N, C]``:
``B`` blocks of ``block_size`` tokens, ``H`` head slots, ``N`` stored states
per block and ``C`` content bytes per (head, state). Specs are frozen attrs
classes validated at construction.
"""

from kvcore.specs.attention import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvcore.specs.base import KVCacheSpec, MultipleOf
from kvcore.specs.state import MambaSpec
from kvcore.specs.uniform import UniformTypeKVCacheSpecs

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "MultipleOf",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
]
