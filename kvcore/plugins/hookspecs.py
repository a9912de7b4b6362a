"""The hooks through which kvcore consults attention-backend plugins (``@kvcore.hookimpl``
functions); kvcore never reads block sizes, layouts or spec changes off a backend class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy
import torch

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.specs import KVCacheSpec, MultipleOf

PROJECT_NAME = "kvcore"
ENTRY_POINT_GROUP = "kvcore.plugins"
CORE_PLUGIN_NAME = "kvcore-core"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kvcore_register_backends(register: Callable[[type[AttentionBackend]], None]) -> None:
    """Register the attention backends this plugin provides (every plugin is asked).

    :param register: call ``register(BackendClass)`` once per backend; it refuses anything but
        an ``AttentionBackend`` subclass with a non-empty str ``name`` that implements
        ``forward`` (the plugin then fails to load, named). A name two plugins register is
        ambiguous: kvcore serves neither and names both.
    :returns: nothing; return values are ignored.
    """


@hookspec(firstresult=True)
def kvcore_supported_kernel_block_sizes(
    backend: type[AttentionBackend], spec: KVCacheSpec | None
) -> list[int | MultipleOf] | None:
    """Kernel block sizes (in tokens) ``backend``'s kernels accept for the layer's ``spec`` (None
    when no spec is known). Stops at the first non-None result; the core default, tried last,
    accepts any size.

    :returns: a non-empty list of ``int`` (that size only) and ``MultipleOf(base)`` for a
        backend this plugin owns, else None. The first ``int`` is the size the backend prefers.
    """


@hookspec(firstresult=True)
def kvcore_customize_spec(backend: type[AttentionBackend], spec: KVCacheSpec) -> KVCacheSpec | None:
    """Adjust the spec the engine described for a layer to what ``backend``, which will serve it,
    stores (e.g. head padding). Stops at the first non-None result; the core default returns
    ``spec`` unchanged.

    :returns: a new spec (``attrs.evolve``) for a backend this plugin owns, else None.
    """


@hookspec(firstresult=True)
def kvcore_supported_layouts(backend: type[AttentionBackend], spec: KVCacheSpec | None) -> list[KVCacheLayout] | None:
    """Physical KV cache layouts ``backend``'s kernels can read for the layer's ``spec`` (None
    when no spec is known). Stops at the first non-None result; with no answer (the core
    default), any layout goes.

    :returns: layouts (members or names), most preferred first, for a backend this plugin owns;
        None for any layout.
    """


@hookspec(firstresult=True)
def kvcore_kernel_requirements(backend: type[AttentionBackend], spec: KVCacheSpec | None) -> KernelRequirements | None:
    """What ``backend``'s kernels need of the memory they read for the layer's (customized)
    ``spec`` (None when no spec is known): devices, dtypes, strides.
    Stops at the first non-None result; the core default, tried last, states no requirement.
    ``KVCache.create`` checks every kernel view of the plan against it before allocating;
    :func:`kvcore.select_backend` reads its ``devices``, ``dtypes`` and ``head_sizes``.

    :returns: a ``kvcore.KernelRequirements`` for a backend this plugin owns, else None.
    """


@hookspec(firstresult=True)
def kvcore_backend_priority(
    backend: type[AttentionBackend], spec: KVCacheSpec | None, device: torch.device
) -> int | None:
    """How much ``backend`` wants to serve the layer's ``spec`` (None when no spec is known) on
    ``device``, the ``torch.device`` the cache will live on (higher wins).
    Stops at the first non-None result; the core default, tried last, is 0. Only asked about
    backends whose requirements admit the device, dtype and head size.

    :returns: an ``int`` for a backend this plugin owns, else None.
    """


class CoreDefaults:
    """kvcore's own answers, registered ``trylast`` so every plugin comes first."""

    @hookimpl(trylast=True)
    def kvcore_supported_kernel_block_sizes(self, backend: Any, spec: Any) -> list[MultipleOf]:
        return [MultipleOf(1)]

    @hookimpl(trylast=True)
    def kvcore_customize_spec(self, backend: Any, spec: KVCacheSpec) -> KVCacheSpec:
        return spec

    @hookimpl(trylast=True)
    def kvcore_kernel_requirements(self, backend: Any, spec: Any) -> KernelRequirements:
        return NO_REQUIREMENTS

    @hookimpl(trylast=True)
    def kvcore_backend_priority(self, backend: Any, spec: Any, device: Any) -> int:
        return 0
