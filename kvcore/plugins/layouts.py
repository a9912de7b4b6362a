"""Choosing the one physical KV cache layout all workers and backends can use."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import pluggy

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.answers import HookAnswers, check_layouts
from kvcore.plugins.backend import AttentionBackend
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs

DEFAULT_LAYOUT = KVCacheLayout.LBNHC
LAYOUT_ENV = "KVCORE_KV_CACHE_LAYOUT"

Supported = Sequence[Sequence[KVCacheLayout | str] | None]
Specs = Iterable[KVCacheSpec] | Mapping[str, KVCacheSpec]


def _names(layouts: Iterable[KVCacheLayout]) -> str:
    return "[" + ", ".join(layout.name for layout in layouts) + "]"


def supported_layouts(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[KVCacheLayout]:
    """Layouts ``backend`` reads for ``spec``, most preferred first (all six for None)."""
    answers = HookAnswers(plugin_manager)
    return answers.stated_layouts(answers.backend(backend), spec) or list(KVCacheLayout)


def resolve_kv_cache_layout(
    supported: Supported, specs: Specs = (), requested: KVCacheLayout | str | None = None
) -> KVCacheLayout:
    """The layout to allocate with.

    ``supported`` holds one list per worker, most preferred first (None: any layout). An explicit
    request (``requested``, else ``KVCORE_KV_CACHE_LAYOUT``) must be one of
    :func:`layout_candidates`; otherwise the first candidate wins, as vLLM resolves it.
    """
    candidates = layout_candidates(supported, specs)
    layout = requested_layout(requested)
    if layout is None:
        return candidates[0]
    if layout not in candidates:
        raise ValueError(
            f"requested KV cache layout {layout.name} is not usable here; candidates: "
            f"{_names(candidates)}. Request one of them (argument or {LAYOUT_ENV})"
        )
    return layout


def requested_layout(requested: KVCacheLayout | str | None) -> KVCacheLayout | None:
    """An explicit layout: ``requested``, else ``KVCORE_KV_CACHE_LAYOUT``, else None."""
    if requested is not None:
        return KVCacheLayout.parse(requested)
    from_env = os.environ.get(LAYOUT_ENV, "").strip()
    try:
        return KVCacheLayout.parse(from_env) if from_env else None
    except ValueError as exc:
        raise ValueError(f"{LAYOUT_ENV}={from_env!r}: {exc}; fix or unset {LAYOUT_ENV}") from None


def layout_candidates(supported: Supported, specs: Specs = ()) -> list[KVCacheLayout]:
    """The layouts :func:`resolve_kv_cache_layout` may pick, its default first.

    Only block-compact ones when ``specs`` differ in (heads, states, page bytes); LBNHC leads
    when no worker states a preference.
    """
    workers = [check_layouts(w) for w in supported if w is not None] or [list(KVCacheLayout)]
    candidates = [layout for layout in workers[0] if all(layout in w for w in workers[1:])]
    if not candidates:
        raise ValueError(
            "workers support no common KV cache layout: "
            + "; ".join(f"worker {i}: {_names(w)}" for i, w in enumerate(workers))
            + ". Use backends that share a layout on every worker."
        )
    flat: list[KVCacheSpec] = []
    for spec in specs.values() if isinstance(specs, Mapping) else specs:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"specs must hold KVCacheSpec objects, got {spec!r}")
        is_uniform = isinstance(spec, UniformTypeKVCacheSpecs)
        flat += spec.kv_cache_specs.values() if is_uniform else [spec]
    shapes = {
        (s.num_heads, s.num_states, s.page_size_bytes)
        for s in flat
        if s.has_layer_views and s.has_cache_pages
    }
    if len(shapes) > 1:
        compact = [layout for layout in candidates if layout.is_block_compact]
        if not compact:
            raise ValueError(
                f"layers with different (heads, states, page bytes) {sorted(shapes)} need a "
                f"block-compact layout (LBNHC, LBHNC, BLNHC or BLHNC), but the workers only "
                f"support {_names(candidates)}"
            )
        candidates = compact
    if all(w is None for w in supported) and DEFAULT_LAYOUT in candidates:
        candidates.remove(DEFAULT_LAYOUT)
        candidates.insert(0, DEFAULT_LAYOUT)
    return candidates
