"""kvcore: a standalone KV-cache memory core for LLM inference engines. Public names (listed by
defining module) load on first use (PEP 562), so ``import kvcore`` alone does not import torch."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "kvcore.specs": "AttentionSpec ChunkedLocalAttentionSpec CrossAttentionSpec "
    "EncoderOnlyAttentionSpec FullAttentionSpec KVCacheSpec MambaSpec MLAAttentionSpec MultipleOf "
    "SlidingWindowSpec UniformTypeKVCacheSpecs",
    "kvcore.memory.layout": "compute_layout_strides KVCacheLayout resolve_kv_cache_layout",
    "kvcore.memory.config": "KVCacheConfig KVCacheGroupSpec KVCacheTensor",
    "kvcore.memory.planner": "plan_kv_cache",
    "kvcore.memory.views": "allocate_kv_cache create_kv_cache_views",
    "kvcore.memory.budget": "MemorySnapshot request_memory",
    "kvcore.plugins.backend": "AttentionBackend AttentionMetadataBuilder CommonAttentionMetadata",
    "kvcore.plugins.hookspecs": "hookimpl hookspec",
    "kvcore.plugins.mixer_backend": "MixerBackend",
    "kvcore.plugins.requirements": "KernelRequirements",
    "kvcore.plugins.auto": "select_backend",
    "kvcore.plugins.negotiate": "negotiate",
    "kvcore.plugins.negotiation": "Negotiation",
    "kvcore.plugins.registry": "get_backend get_plugin_manager",
    "kvcore.plugins.block_sizes": "customize_attention_spec get_block_table_width "
    "prepare_kernel_block_sizes select_common_block_size",
    "kvcore.plugins.layouts": "supported_layouts",
    "kvcore.runtime.attn_group": "AttentionGroup build_attention_groups "
    "map_kv_caches_to_kernel_blocks",
    "kvcore.runtime.block_pool": "BlockPool",
    "kvcore.runtime.prefix_hash": "block_hashes sliding_window_blocks",
    "kvcore.runtime.kv_cache": "KVCache",
    "kvcore.runtime.zeroer": "KVBlockZeroer",
    "kvcore.model_runner": "get_uniform_decode_token_count is_uniform_query_len",
    "kvcore.model_runner.binding": "add_kv_sharing_layers_to_kv_cache_groups bind_kv_cache "
    "bind_kv_cache_to_layers clear_layer_kv_caches extract_layer_index "
    "initialize_kv_cache_for_kv_sharing",
    "kvcore.model_runner.multimodal": "EncoderTimingStats gather_mm_placeholders "
    "sanity_check_mm_encoder_outputs scatter_mm_placeholders",
}
_ORIGIN = {name: module for module, names in _EXPORTS.items() for name in names.split()}

__all__ = [*_ORIGIN, "distributed", "errors", "__version__"]


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule such as ``kvcore.errors``) on first use."""
    if name in _ORIGIN:
        value = getattr(importlib.import_module(_ORIGIN[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # NOTE: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
