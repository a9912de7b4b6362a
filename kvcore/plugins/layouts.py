"""The layouts a backend reads (asked through its plugin), and the one layout a set of workers
uses (decided in ``kvcore.memory.layout``, re-exported here)."""

from __future__ import annotations

import pluggy

from kvcore.memory.layout import KVCacheLayout, layout_candidates, resolve_kv_cache_layout
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.backend import AttentionBackend
from kvcore.specs import KVCacheSpec

__all__ = ["layout_candidates", "resolve_kv_cache_layout", "supported_layouts"]


def supported_layouts(backend: type[AttentionBackend] | str, spec: KVCacheSpec | None = None, *,
                      plugin_manager: pluggy.PluginManager | None = None) -> list[KVCacheLayout]:
    """Layouts ``backend`` reads for ``spec``, most preferred first (all six for None)."""
    answers = HookAnswers(plugin_manager)
    return answers.stated_layouts(answers.backend(backend), spec) or list(KVCacheLayout)
