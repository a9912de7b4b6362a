"""kvcore: a standalone KV-cache memory core for LLM inference engines.

Every public name is importable from ``kvcore``; submodules hold one concept
each. Names are resolved lazily so ``import kvcore`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # specs
    "KVCacheSpec": "kvcore.specs",
    "AttentionSpec": "kvcore.specs",
    "FullAttentionSpec": "kvcore.specs",
    "SlidingWindowSpec": "kvcore.specs",
    "ChunkedLocalAttentionSpec": "kvcore.specs",
    "MLAAttentionSpec": "kvcore.specs",
    "EncoderOnlyAttentionSpec": "kvcore.specs",
    "CrossAttentionSpec": "kvcore.specs",
    "MambaSpec": "kvcore.specs",
    "UniformTypeKVCacheSpecs": "kvcore.specs",
    "MultipleOf": "kvcore.specs",
    # layouts, tensors, views
    "KVCacheLayout": "kvcore.layout",
    "compute_layout_strides": "kvcore.layout",
    "KVCacheTensor": "kvcore.config",
    "KVCacheGroupSpec": "kvcore.config",
    "KVCacheConfig": "kvcore.config",
    "create_kv_cache_views": "kvcore.views",
    "allocate_kv_cache": "kvcore.views",
    # plugins and attention groups
    "hookspec": "kvcore.hookspecs",
    "hookimpl": "kvcore.hookspecs",
    "get_plugin_manager": "kvcore.plugins",
    "AttentionBackend": "kvcore.backend",
    "AttentionMetadataBuilder": "kvcore.backend",
    "CommonAttentionMetadata": "kvcore.backend",
    "select_common_block_size": "kvcore.block_sizes",
    "customize_attention_spec": "kvcore.block_sizes",
    "prepare_kernel_block_sizes": "kvcore.block_sizes",
    "AttentionGroup": "kvcore.attn_group",
    "build_attention_groups": "kvcore.group_builder",
    "map_kv_caches_to_kernel_blocks": "kvcore.group_builder",
    "resolve_kv_cache_layout": "kvcore.layout_resolution",
    # zeroer
    "KVBlockZeroer": "kvcore.zeroer",
    # planner, memory, binding, batch helpers
    "plan_kv_cache": "kvcore.planner",
    "MemorySnapshot": "kvcore.memory",
    "request_memory": "kvcore.memory",
    "add_kv_sharing_layers_to_kv_cache_groups": "kvcore.binding",
    "initialize_kv_cache_for_kv_sharing": "kvcore.binding",
    "bind_kv_cache": "kvcore.binding",
    "bind_kv_cache_to_layers": "kvcore.binding",
    "clear_layer_kv_caches": "kvcore.binding",
    "extract_layer_index": "kvcore.binding",
    "is_uniform_query_len": "kvcore.batch",
    "get_uniform_decode_token_count": "kvcore.batch",
    "scatter_mm_placeholders": "kvcore.batch",
    "gather_mm_placeholders": "kvcore.batch",
    "sanity_check_mm_encoder_outputs": "kvcore.batch",
    "EncoderTimingStats": "kvcore.batch",
    # runtime
    "BlockPool": "kvcore.block_pool",
    "KVCache": "kvcore.runtime",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
