"""Every hook answer one negotiation needs, each asked once per (backend, spec).

:class:`HookAnswers` is how the negotiation stage talks to plugins: kernel
block sizes, layouts, customized specs, kernel requirements and priorities,
each kept once asked (unhashable specs by identity), so a later need for the
same answer is served from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pluggy

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.checks import (
    check_customized,
    check_layouts,
    check_priority,
    check_requirements,
    check_sizes,
)
from kvcore.plugins.manager import call_first
from kvcore.plugins.registry import resolve_backend, resolve_plugin_manager
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.plugins.selection import fixed_sizes
from kvcore.specs import KVCacheSpec, MultipleOf

ALL_LAYOUTS: tuple[KVCacheLayout, ...] = tuple(KVCacheLayout)


def label(backend: type[AttentionBackend]) -> str:
    """A backend's name in messages (its class name when it has none, as the base class)."""
    return getattr(backend, "name", None) or backend.__qualname__


def _key(backend: type, spec: Any) -> tuple[type, Any]:
    try:
        hash(spec)
    except TypeError:
        return backend, ("unhashable", id(spec))
    return backend, spec


def key_of(spec: Any) -> Any:
    return _key(type, spec)[1]


class HookAnswers:
    """Every hook answer one negotiation needs, each asked once per (backend, spec)."""

    def __init__(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        self.pm = resolve_plugin_manager(plugin_manager)
        self._sizes: dict[Any, list[int | MultipleOf]] = {}
        self._specs: dict[Any, KVCacheSpec] = {}
        self._layouts: dict[Any, list[KVCacheLayout] | None] = {}
        self._requirements: dict[Any, KernelRequirements] = {}
        #: customized spec -> the backend whose customize hook padded its page
        self.padded_by: dict[Any, str] = {}
        self._keep: list[Any] = []  # NOTE: keeps unhashable specs alive while their id is a key

    def backend(self, backend: type[AttentionBackend] | str) -> type[AttentionBackend]:
        return resolve_backend(backend, self.pm)

    def kernel_block_sizes(self, backend: type[AttentionBackend], spec: KVCacheSpec | None) -> list[int | MultipleOf]:
        """``kvcore_supported_kernel_block_sizes`` for (backend, spec)."""
        key = _key(backend, spec)
        if key not in self._sizes:
            self._keep.append(spec)
            found = call_first(
                self.pm, "kvcore_supported_kernel_block_sizes", check_sizes, backend=backend, spec=spec
            )
            self._sizes[key] = [MultipleOf(1)] if found is None else found
        return self._sizes[key]

    def stated_layouts(self, backend: type[AttentionBackend], spec: KVCacheSpec | None) -> list[KVCacheLayout] | None:
        """``kvcore_supported_layouts`` for (backend, spec): layouts, or None for any."""
        key = _key(backend, spec)
        if key not in self._layouts:
            self._keep.append(spec)
            self._layouts[key] = call_first(
                self.pm, "kvcore_supported_layouts", check_layouts, backend=backend, spec=spec
            )
        return self._layouts[key]

    def requirements(self, backend: type[AttentionBackend], spec: KVCacheSpec | None) -> KernelRequirements:
        """``kvcore_kernel_requirements`` for (backend, spec) (no requirements when unanswered)."""
        key = _key(backend, spec)
        if key not in self._requirements:
            self._keep.append(spec)
            found = call_first(
                self.pm, "kvcore_kernel_requirements", check_requirements, backend=backend, spec=spec
            )
            self._requirements[key] = NO_REQUIREMENTS if found is None else found
        return self._requirements[key]

    def priority(self, backend: type[AttentionBackend], spec: KVCacheSpec | None, device: Any) -> int:
        """``kvcore_backend_priority`` for (backend, spec, device) (0 when unanswered)."""
        found = call_first(
            self.pm, "kvcore_backend_priority", check_priority, backend=backend, spec=spec, device=device
        )
        return 0 if found is None else found

    def layouts(self, backend: type[AttentionBackend], spec: KVCacheSpec | None) -> list[KVCacheLayout]:
        """:meth:`stated_layouts`, with all six layouts for "any"."""
        stated = self.stated_layouts(backend, spec)
        return list(ALL_LAYOUTS) if stated is None else list(stated)

    def customized_spec(self, backend: type[AttentionBackend], spec: KVCacheSpec) -> KVCacheSpec:
        """``spec`` as ``backend`` stores it: the hook's answer, then block-stride alignment.

        When every kernel size the backend takes is a fixed int and the spec
        asks no alignment yet, it gets ``MultipleOf(max(sizes))``. The aligned
        spec shares the sizes answer of the spec it came from.
        """
        key = _key(backend, spec)
        if key in self._specs:
            return self._specs[key]
        self._keep.append(spec)
        new = call_first(
            self.pm, "kvcore_customize_spec", lambda value: check_customized(spec, value, label(backend)),
            backend=backend, spec=spec,
        ) or spec
        padded = new.page_size_padded is not None and new.page_size_padded != spec.page_size_padded
        if new.is_attention and new.block_stride_alignment is None:
            sizes = self.kernel_block_sizes(backend, new)
            fixed = fixed_sizes(sizes)
            if sizes and len(fixed) == len(sizes):
                new = attrs.evolve(new, block_stride_alignment=MultipleOf(max(fixed)))
                self._sizes.setdefault(_key(backend, new), sizes)
        if padded:
            self.padded_by[key_of(new)] = label(backend)
        self._specs[key] = new
        return new

    def common_layouts(
        self, pairs: Sequence[tuple[type[AttentionBackend], KVCacheSpec | None]]
    ) -> list[KVCacheLayout] | None:
        """Layouts every (backend, spec) reads, in the first choosy backend's order.

        None when no backend states a preference (every answer was "any").
        """
        stated = [self.stated_layouts(b, s) for b, s in pairs]
        lists = [ls for ls in stated if ls is not None]
        if not lists:
            return None
        common = [layout for layout in lists[0] if all(layout in ls for ls in lists[1:])]
        if not common:
            offered = "; ".join(
                f"{label(b)}: [{', '.join(x.name for x in ls)}]"
                for (b, _), ls in zip(pairs, stated) if ls is not None
            )
            raise ValueError(
                f"the backends share no KV cache layout: {offered}. "
                "Serve these layers with backends that agree on a layout."
            )
        return common


__all__ = ["ALL_LAYOUTS", "HookAnswers", "key_of", "label"]
