"""kvcore: a standalone KV-cache memory core for LLM inference engines.

Engines describe each layer's KV cache with a spec; kvcore plans one backing
allocation, gives every layer a strided view in one of six layouts, negotiates
kernel block sizes with attention-backend plugins, and zeroes new blocks in one
launch. Every public name is importable from here.
"""

from __future__ import annotations

from kvcore.runtime.attn_group import AttentionGroup
from kvcore.plugins.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from kvcore.model_runner.batch import (
    EncoderTimingStats,
    gather_mm_placeholders,
    get_uniform_decode_token_count,
    is_uniform_query_len,
    sanity_check_mm_encoder_outputs,
    scatter_mm_placeholders,
)
from kvcore.model_runner.binding import (
    add_kv_sharing_layers_to_kv_cache_groups,
    bind_kv_cache,
    bind_kv_cache_to_layers,
    clear_layer_kv_caches,
    extract_layer_index,
    initialize_kv_cache_for_kv_sharing,
)
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.prefix_hash import block_hashes, sliding_window_blocks
from kvcore.plugins.block_sizes import (
    customize_attention_spec,
    prepare_kernel_block_sizes,
    select_common_block_size,
)
from kvcore.memory.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from kvcore.runtime.group_builder import (
    build_attention_groups,
    map_kv_caches_to_kernel_blocks,
)
from kvcore.plugins.hookspecs import (
    hookimpl,
    hookspec,
)
from kvcore.memory.layout import (
    compute_layout_strides,
    KVCacheLayout,
)
from kvcore.plugins.layouts import resolve_kv_cache_layout
from kvcore.memory.budget import (
    MemorySnapshot,
    request_memory,
)
from kvcore.memory.planner import plan_kv_cache
from kvcore.plugins.registry import get_plugin_manager
from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from kvcore.memory.views import (
    allocate_kv_cache,
    create_kv_cache_views,
)
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore import distributed, errors

__version__ = "0.1.0"

__all__ = [
    "add_kv_sharing_layers_to_kv_cache_groups",
    "allocate_kv_cache",
    "AttentionBackend",
    "AttentionGroup",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "bind_kv_cache",
    "bind_kv_cache_to_layers",
    "BlockPool",
    "block_hashes",
    "sliding_window_blocks",
    "build_attention_groups",
    "ChunkedLocalAttentionSpec",
    "clear_layer_kv_caches",
    "CommonAttentionMetadata",
    "compute_layout_strides",
    "create_kv_cache_views",
    "CrossAttentionSpec",
    "customize_attention_spec",
    "EncoderOnlyAttentionSpec",
    "EncoderTimingStats",
    "extract_layer_index",
    "FullAttentionSpec",
    "gather_mm_placeholders",
    "get_plugin_manager",
    "get_uniform_decode_token_count",
    "hookimpl",
    "hookspec",
    "initialize_kv_cache_for_kv_sharing",
    "is_uniform_query_len",
    "KVBlockZeroer",
    "KVCache",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "MambaSpec",
    "map_kv_caches_to_kernel_blocks",
    "MemorySnapshot",
    "MLAAttentionSpec",
    "MultipleOf",
    "plan_kv_cache",
    "prepare_kernel_block_sizes",
    "request_memory",
    "resolve_kv_cache_layout",
    "sanity_check_mm_encoder_outputs",
    "scatter_mm_placeholders",
    "select_common_block_size",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "distributed",
    "errors",
    "__version__",
]
