"""Negotiation: the one place where ``KVCache.create`` asks the backend hooks.

:class:`HookAnswers` asks each hook at most once per distinct (backend, spec)
and keeps the answer. :func:`negotiate` turns a plan and those answers into
one frozen :class:`~kvcore.plugins.records.GroupNegotiation` per KV cache
group — backends, the customized spec, the kernel block size, the split
ratio of the views as allocated and each backend's kernel block stride —
which the allocator, attention groups, metadata builders and zeroer then
read instead of asking again. The public helpers of :mod:`kvcore.plugins.block_sizes` and
:mod:`kvcore.plugins.layouts` are thin one-shot wrappers over the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pluggy

from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.plan_groups import is_encoder_only
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.checks import (
    check_customized,
    check_layouts,
    check_priority,
    check_requirements,
    check_sizes,
)
from kvcore.plugins.kernel_views import packed_kernel_stride
from kvcore.plugins.manager import call_first
from kvcore.plugins.registry import resolve_backend, resolve_plugin_manager
from kvcore.plugins.records import BackendNegotiation, GroupNegotiation, Negotiation
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.plugins.selection import fixed_sizes, pick_common_block_size
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


def _key_of(spec: Any) -> Any:
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
            self.padded_by[_key_of(new)] = label(backend)
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




def can_split(spec: KVCacheSpec) -> bool:
    """Whether manager blocks of ``spec`` may be split into kernel blocks.

    Only attention pages whose state count grows with the block size can; a
    spec storing one state per block (``tokens_per_state <= 0``) keeps whole blocks.
    """
    return spec.has_layer_views and spec.is_attention and spec.tokens_per_state > 0


def is_packed(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    """Whether a group's tensor interleaves other layers' pages between its blocks."""
    names = set(group.layer_names)
    return any(
        len(t.layers) > 1 and t.block_stride > t.layer_stride
        for t in config.kv_cache_tensors
        if not names.isdisjoint(t.layers)
    )


def splits_by_backends(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    """Whether a group's kernel block size is chosen by its backends.

    Groups without pages, state caches, one-state-per-block specs and packed
    groups keep their manager block size (packed groups' backends may still
    map their own kernel tables).
    """
    return (
        not is_encoder_only(group)
        and can_split(group.spec_of(group.layer_names[0]))
        and not is_packed(config, group)
    )


def group_kernel_block_size(
    config: KVCacheConfig,
    group_id: int,
    pairs: Sequence[tuple[type[AttentionBackend], KVCacheSpec]],
    answers: HookAnswers,
) -> int | None:
    """The kernel block size of KV cache group ``group_id`` (None: the group has no pages)."""
    group = config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    if is_encoder_only(group):
        return None
    if not splits_by_backends(config, group):
        return spec.block_size
    offers = [(label(b), answers.kernel_block_sizes(b, s)) for b, s in pairs]
    return pick_common_block_size(spec.block_size, offers)


def _check_dense_split(config: KVCacheConfig, group: KVCacheGroupSpec, kernel: int, answers: HookAnswers) -> None:
    """A padded page cannot be split into kernel blocks: say who padded it (not the layout)."""
    spec = group.kv_cache_spec
    if spec.page_size_padded is None or spec.page_size_padded == spec.real_page_size_bytes:
        return
    padder = answers.padded_by.get(_key_of(spec))
    who = (
        f"backend {padder!r}'s kvcore_customize_spec padded" if padder is not None
        else "the plan padded (to unify page sizes across layer types)"
    )
    raise ValueError(
        f"{who} the {spec.real_page_size_bytes}-byte pages of {list(group.layer_names)} to "
        f"{spec.page_size_padded} bytes, and padded pages cannot be split into {kernel}-token "
        f"kernel blocks; use a manager block size of {kernel} tokens"
        + (", or a backend that does not pad pages" if padder is not None else "")
    )


def backend_groups(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
    *,
    customize: bool,
) -> list[dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]]]:
    """Per KV cache group, (backend, spec) -> its layers, in config order.

    ``customize=True`` customizes each layer's spec through the hooks;
    False when the config was planned from customized specs. Attention layers
    need a backend; state-cache layers without one are left out, and groups
    without layer views get none.
    """
    out = []
    for gid, group in enumerate(config.kv_cache_groups):
        by_key: dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]] = {}
        if group.spec_of(group.layer_names[0]).has_layer_views:
            for name in group.layer_names:
                layer_spec = group.spec_of(name)
                if name not in layer_backends:
                    if layer_spec.is_attention:
                        raise ValueError(
                            f"attention layer {name!r} (KV cache group {gid}) has no backend in "
                            "layer_backends; map every attention layer of the config to a backend"
                        )
                    continue
                backend = layer_backends[name]
                spec = answers.customized_spec(backend, layer_spec) if customize else layer_spec
                by_key.setdefault((backend, spec), []).append(name)
        out.append(by_key)
    return out


def negotiate(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
) -> Negotiation:
    """One record per KV cache group of ``config``, planned from customized specs.

    Each group's kernel block size, the split ratio of its views as
    allocated and each backend's own kernel block size and stride are decided
    here, once; a packed group a backend cannot split raises ``ValueError``
    before anything is allocated.
    """
    records = []
    for gid, by_key in enumerate(backend_groups(config, layer_backends, answers, customize=False)):
        group = config.kv_cache_groups[gid]
        kernel = group_kernel_block_size(config, gid, list(by_key), answers)
        packed = is_packed(config, group)
        entries = []
        for (backend, spec), names in by_key.items():
            own, stride = None, 0
            if kernel is not None and packed and can_split(spec):
                offer = [(label(backend), answers.kernel_block_sizes(backend, spec))]
                own = pick_common_block_size(kernel, offer)
                if own == spec.block_size:
                    own = None
                else:
                    tensor = next(t for t in config.kv_cache_tensors if names[0] in t.layers)
                    stride = packed_kernel_stride(spec, tensor.block_stride, own, label(backend), names)
            elif kernel is not None and kernel != spec.block_size:
                own = kernel
            entries.append(BackendNegotiation(
                backend, tuple(names), spec, kernel, own, stride, answers.requirements(backend, spec)
            ))
        ratio = 1 if kernel is None or packed else group.kv_cache_spec.block_size // kernel
        if ratio > 1:
            _check_dense_split(config, group, kernel, answers)
        records.append(GroupNegotiation(
            gid, tuple(group.layer_names), group.kv_cache_spec, kernel, ratio,
            not is_encoder_only(group), tuple(entries),
        ))
    return Negotiation(tuple(records))


def backend_kernel_block_size(
    answers: HookAnswers, backend: type[AttentionBackend], spec: KVCacheSpec, kernel_block_size: int
) -> int | None:
    """A standalone group's own kernel block size for a group size (None: no split)."""
    if not can_split(spec):
        return None
    own = pick_common_block_size(kernel_block_size, [(label(backend), answers.kernel_block_sizes(backend, spec))])
    return None if own == spec.block_size else own


__all__ = [
    "BackendNegotiation",
    "GroupNegotiation",
    "HookAnswers",
    "Negotiation",
    "backend_groups",
    "backend_kernel_block_size",
    "can_split",
    "group_kernel_block_size",
    "is_packed",
    "negotiate",
    "splits_by_backends",
]
