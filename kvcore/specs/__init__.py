"""Stage 1, what one layer stores per block: frozen, validated spec classes."""

from kvcore.specs.attention import (  # noqa: F401
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvcore.specs.base import KVCacheSpec, MultipleOf, UniformTypeKVCacheSpecs  # noqa: F401
from kvcore.specs.state import MambaSpec  # noqa: F401
