"""Input checks of the torch backend's entry points (kvcore's shared paged-input checks)."""

from kvcore.plugins.paged_inputs import (
    check_batch,
    check_batch_shapes,
    check_block_ids,
    check_cache_view,
    check_heads_and_window,
    check_index,
    check_kv_write,
    check_tokens,
    value_checks,
)

__all__ = [
    "check_batch",
    "check_batch_shapes",
    "check_block_ids",
    "check_cache_view",
    "check_heads_and_window",
    "check_index",
    "check_kv_write",
    "check_tokens",
    "value_checks",
]
