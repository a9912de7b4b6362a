"""Stage 3 of the pipeline: negotiation with attention-backend plugins.

The backend protocol (``backend``), the hook specifications (``hookspecs``),
the plugin manager and its loading (``manager``, ``registry``), checks of
hook answers and pure block-size arithmetic (``checks``, ``selection``),
``negotiation`` — the one module ``KVCache.create`` asks the hooks through,
keeping one record per KV cache group (``records``) — the kernel rules
(``requirements``: what a backend declares; ``kernel_rules``: the plan held
to them; ``kernel_views``: packed kernel views), the backend a device gets
(``auto``: ``select_backend``, ``"auto"``, preferred block sizes), the public
one-shot helpers over the negotiation (``block_sizes``, ``layouts``) and the
``kvcore plugins`` health check (``health``). Backend authors also use
``paged_inputs`` to check a step's K/V inputs.
"""

from kvcore.plugins.registry import (
    PluginSettings,
    build_plugin_manager,
    default_plugin_manager,
    get_backend,
    get_backends,
    get_plugin_manager,
    list_plugins,
    reset_default_plugin_manager,
    resolve_backend,
    resolve_plugin_manager,
)

__all__ = [
    "PluginSettings",
    "build_plugin_manager",
    "default_plugin_manager",
    "get_backend",
    "get_backends",
    "get_plugin_manager",
    "list_plugins",
    "reset_default_plugin_manager",
    "resolve_backend",
    "resolve_plugin_manager",
]
