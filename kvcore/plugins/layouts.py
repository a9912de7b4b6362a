"""Choosing the one physical KV cache layout all workers and backends can use."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pluggy

from kvcore.plugins.backend import AttentionBackend
from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.manager import call_first
from kvcore.plugins.registry import resolve_backend, resolve_plugin_manager
from kvcore.specs import EncoderOnlyAttentionSpec, KVCacheSpec, UniformTypeKVCacheSpecs

ALL_LAYOUTS: tuple[KVCacheLayout, ...] = tuple(KVCacheLayout)
DEFAULT_LAYOUT = KVCacheLayout.LBNHC
LAYOUT_ENV = "KVCORE_KV_CACHE_LAYOUT"


def _names(layouts: Iterable[KVCacheLayout]) -> str:
    return "[" + ", ".join(layout.name for layout in layouts) + "]"


def _parse_list(value: Any) -> list[KVCacheLayout]:
    if isinstance(value, (str, KVCacheLayout)) or not isinstance(value, Iterable):
        raise TypeError(f"expected a list of KV cache layouts, got {value!r}")
    out: list[KVCacheLayout] = []
    for item in value:
        layout = KVCacheLayout.parse(item)
        if layout not in out:
            out.append(layout)
    if not out:
        raise ValueError("expected at least one layout (return None to accept any)")
    return out


def supported_layouts(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[KVCacheLayout]:
    """Layouts ``backend`` reads for ``spec``, most preferred first (all six if its plugin says None)."""
    pm = resolve_plugin_manager(plugin_manager)
    backend = resolve_backend(backend, pm)
    found = call_first(pm, "kvcore_supported_layouts", _parse_list, backend=backend, spec=spec)
    return list(ALL_LAYOUTS) if found is None else found


def local_supported_layouts(
    backends: Sequence[type[AttentionBackend] | str],
    specs: Sequence[KVCacheSpec | None] | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[KVCacheLayout]:
    """Layouts every backend of this worker reads, in the first choosy backend's order.

    This is one worker's entry of ``supported`` for :func:`resolve_kv_cache_layout`.
    """
    specs = [None] * len(backends) if specs is None else list(specs)
    if len(specs) != len(backends):
        raise ValueError(f"got {len(specs)} specs for {len(backends)} backends; pass one per backend")
    lists = [supported_layouts(b, s, plugin_manager=plugin_manager) for b, s in zip(backends, specs)]
    # NOTE: an "any layout" answer carries no preference, so order by the first real one.
    ordered = sorted(lists, key=lambda ls: len(ls) == len(ALL_LAYOUTS))
    first = ordered[0] if ordered else list(ALL_LAYOUTS)
    common = [layout for layout in first if all(layout in ls for ls in lists)]
    if not common:
        raise ValueError(
            "the backends share no KV cache layout: "
            + "; ".join(f"{resolve_backend(b, plugin_manager).get_name()}: {_names(ls)}"
                        for b, ls in zip(backends, lists))
            + ". Serve these layers with backends that agree on a layout."
        )
    return common


def _flat_specs(specs: Iterable[KVCacheSpec] | Mapping[str, KVCacheSpec]) -> list[KVCacheSpec]:
    values = specs.values() if isinstance(specs, Mapping) else specs
    out: list[KVCacheSpec] = []
    for spec in values:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            out.extend(spec.kv_cache_specs.values())
        elif isinstance(spec, KVCacheSpec):
            out.append(spec)
        else:
            raise TypeError(f"specs must hold KVCacheSpec objects, got {spec!r}")
    return out


def resolve_kv_cache_layout(
    supported: Sequence[Sequence[KVCacheLayout | str] | None],
    specs: Iterable[KVCacheSpec] | Mapping[str, KVCacheSpec] = (),
    requested: KVCacheLayout | str | None = None,
) -> KVCacheLayout:
    """The layout to allocate with.

    ``supported`` holds one list per worker, most preferred first (None: any
    layout). Candidates are the layouts every worker supports, in the first
    worker's order. When ``specs`` differ in (heads, states, page bytes) only
    block-compact layouts can hold them, so candidates narrow to those. An
    explicit request (``requested``, else ``KVCORE_KV_CACHE_LAYOUT``) must be a
    candidate; otherwise LBNHC when it is one, else the first candidate.
    """
    workers = [list(ALL_LAYOUTS) if w is None else _parse_list(w) for w in supported]
    if not workers:
        workers = [list(ALL_LAYOUTS)]
    candidates = [layout for layout in workers[0] if all(layout in w for w in workers[1:])]
    if not candidates:
        raise ValueError(
            "workers support no common KV cache layout: "
            + "; ".join(f"worker {i}: {_names(w)}" for i, w in enumerate(workers))
            + ". Use backends that share a layout on every worker."
        )
    shapes = {
        (s.num_heads, s.num_states, s.page_size_bytes)
        for s in _flat_specs(specs)
        if s.has_layer_views and not isinstance(s, EncoderOnlyAttentionSpec)
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
    if requested is None:
        requested = os.environ.get(LAYOUT_ENV, "").strip() or None
    if requested is not None:
        layout = KVCacheLayout.parse(requested)
        if layout not in candidates:
            raise ValueError(
                f"requested KV cache layout {layout.name} is not usable here; candidates: "
                f"{_names(candidates)}. Request one of them (argument or {LAYOUT_ENV})"
            )
        return layout
    return DEFAULT_LAYOUT if DEFAULT_LAYOUT in candidates else candidates[0]
