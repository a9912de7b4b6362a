"""Stage 3 of the pipeline: negotiation with attention-backend plugins.

``backend`` (the protocol) and ``hookspecs``; ``manager``/``registry`` (pluggy, loading,
backends); ``answers`` (each hook asked once, answers checked); ``negotiation`` (one record per
KV cache group); ``requirements``/``kernel_rules``/``auto`` (what kernels need, the plan held to
it, the backend a device gets); ``block_sizes``/``layouts`` (public one-shot helpers);
``health`` (``kvcore plugins``); ``paged_inputs`` (backends' input checks).
"""

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
