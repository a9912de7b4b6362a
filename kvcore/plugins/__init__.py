"""Stage 3 of the pipeline: negotiation with attention-backend plugins (pluggy): the backend
protocol and hooks, the plugin manager, each hook asked once, one record per KV cache group."""

from kvcore.plugins.registry import (
    default_plugin_manager,
    get_backend,
    get_backends,
    get_plugin_manager,
    list_plugins,
    reset_default_plugin_manager,
)

__all__ = [
    "default_plugin_manager",
    "get_backend",
    "get_backends",
    "get_plugin_manager",
    "list_plugins",
    "reset_default_plugin_manager",
]
