"""Holding a plan to its backends' ``KernelRequirements`` before anything is allocated: the first
preferred layout that meets every rule, else a ``KernelRequirementError`` with a remedy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcore.errors import KernelRequirementError, PluginError
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.answers import HookAnswers, label
from kvcore.plugins.auto import choose_backend, serves
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.layouts import layout_candidates, requested_layout, resolve_kv_cache_layout
from kvcore.plugins.negotiation import Negotiation, negotiate, to_kernel_blocks
from kvcore.specs import AttentionSpec, KVCacheSpec

Backends = Mapping[str, type[AttentionBackend]]
Specs = Mapping[str, KVCacheSpec]


def check_abilities(
    answers: HookAnswers, specs: Specs, backends: Backends, device: torch.device
) -> None:
    for layer, backend in backends.items():
        why = serves(answers, backend, specs[layer], device)
        if why is None:
            continue
        try:
            other = choose_backend(answers, specs[layer], device)
            remedy = f"serve it with backend {label(other)!r} (or 'auto')"
        except ValueError:
            remedy = "no registered backend can serve it there; use another device or dtype"
        raise KernelRequirementError(
            f"backend {label(backend)!r} cannot serve layer {layer!r}: it {why}; {remedy}"
        )


def kernel_views(config: KVCacheConfig, negotiation: Negotiation) -> dict[str, torch.Tensor]:
    """Every layer's kernel view of the plan, over a ``meta`` buffer (nothing allocated)."""
    views = allocate_kv_cache(
        config, torch.device("meta"), None, negotiation.allocation_kernel_block_sizes
    )
    for entry in (e for g in negotiation.groups for e in g.backends if e.kernel_block_stride):
        rows = entry.kv_cache_spec.get_num_kernel_states(entry.kernel_block_size)
        for name in entry.layer_names:
            views[name] = to_kernel_blocks(views[name], rows, entry.kernel_block_stride)
    return views


def first_violation(config: KVCacheConfig, negotiation: Negotiation) -> str | None:
    """The first kernel view of the plan that breaks its backend's stride or alignment rules."""
    entries = [e for g in negotiation.groups for e in g.backends if e.requirements.has_memory_rules]
    views = kernel_views(config, negotiation) if entries else {}
    for entry in entries:
        for name in entry.layer_names:
            view = views.get(name)
            if view is None or view.dim() != 4:
                continue
            size = view.element_size()
            offset = view.storage_offset() * size
            found = entry.requirements.view_violation(view.stride(), size, offset)
            if found is not None:
                rule, value, needed = found
                return (
                    f"backend {label(entry.backend)!r} cannot read layer {name!r} in layout "
                    f"{config.layout.name}: rule {rule} needs {needed}, got {value}"
                )
    return None


def _plan(
    specs: Specs, backends: Backends, answers: HookAnswers, layout: KVCacheLayout, budget: dict
) -> tuple[KVCacheConfig, Negotiation]:
    config = plan_kv_cache(specs, layout, **budget)
    return config, negotiate(config, backends, answers)


def _meets(*args: Any) -> bool:
    try:
        return first_violation(*_plan(*args)) is None
    except PluginError:
        raise
    except ValueError:
        return False


def _resized(layer_specs: Specs, backends: Backends, answers: HookAnswers, size: int) -> Specs:
    """``layer_specs`` with ``size``-token attention blocks, as their backends store them."""
    out = {}
    for name, spec in layer_specs.items():
        if isinstance(spec, AttentionSpec):
            spec = spec.copy_with_new_block_size(size)
        out[name] = answers.customized_spec(backends[name], spec) if name in backends else spec
    return out


def _remedy(
    layer_specs: Specs,
    specs: Specs,
    backends: Backends,
    answers: HookAnswers,
    untried: Sequence[KVCacheLayout],
    candidates: Sequence[KVCacheLayout],
    budget: dict,
) -> str:
    """A layout, else a block size (with a layout), that meets every rule."""
    good = [lay for lay in untried if _meets(specs, backends, answers, lay, budget)]
    if good:
        return f"layout {good[0].name} meets every rule (pass layout={good[0].name!r} or None)"
    sizes = sorted({s.block_size for s in layer_specs.values() if isinstance(s, AttentionSpec)})
    tries = [sizes[0] // 2, sizes[0] // 4, sizes[0] * 2, sizes[0] * 4] if len(sizes) == 1 else []
    for size in tries:
        try:
            resized = _resized(layer_specs, backends, answers, size)
        except ValueError:
            continue
        for lay in candidates:
            if _meets(resized, backends, answers, lay, budget):
                return f"{size}-token blocks in layout {lay.name} meet every rule"
    return (
        "no layout or block size tried meets it; plan fewer blocks or serve these layers with "
        "another backend"
    )


def _has_memory_rules(specs: Specs, backends: Backends, answers: HookAnswers) -> bool:
    return any(answers.requirements(b, specs[n]).has_memory_rules for n, b in backends.items())


def plan_meeting_rules(
    layer_specs: Specs,
    specs: Specs,
    backends: Backends,
    answers: HookAnswers,
    supported: Sequence[KVCacheLayout] | None,
    layout: KVCacheLayout | str | None,
    budget: dict[str, Any],
) -> tuple[KVCacheLayout, KVCacheConfig, Negotiation]:
    """The layout, plan and negotiation whose kernel views meet every backend's rules.

    ``layer_specs``: the engine's specs; ``specs``: the customized ones; ``budget``: the planner's.
    """
    candidates = layout_candidates([supported], specs.values())
    explicit = requested_layout(layout) is not None
    tried = candidates
    if explicit or not _has_memory_rules(specs, backends, answers):
        tried = [resolve_kv_cache_layout([supported], specs.values(), layout)]
    first: str | None = None
    error: ValueError | None = None
    for candidate in tried:
        try:
            config, negotiation = _plan(specs, backends, answers, candidate, budget)
        except PluginError:
            raise
        except ValueError as exc:
            error = error or exc
            continue
        violation = first_violation(config, negotiation)
        if violation is None:
            return candidate, config, negotiation
        first = first or violation
    if first is None:
        raise error  # type: ignore[misc]
    untried = [c for c in candidates if c not in tried]
    remedy = _remedy(layer_specs, specs, backends, answers, untried, candidates, budget)
    names = ", ".join(c.name for c in candidates)
    prefix = "" if explicit else f"no layout of [{names}] meets every kernel rule: "
    raise KernelRequirementError(f"{prefix}{first}; {remedy}")


def layouts_meeting_rules(
    specs: Specs,
    backends: Backends,
    answers: HookAnswers,
    supported: Sequence[KVCacheLayout] | None,
    budget: dict[str, Any],
) -> Sequence[KVCacheLayout] | None:
    """``supported`` narrowed to layouts whose plan meets every rule (a distributed agreement)."""
    if not _has_memory_rules(specs, backends, answers):
        return supported
    candidates = layout_candidates([supported], specs.values())
    return [c for c in candidates if _meets(specs, backends, answers, c, budget)] or supported
