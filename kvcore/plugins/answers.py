"""What the backends' plugins answered: each hook asked once per (backend, spec), checked (a wrong
answer names the plugin whose answer it is), kept; a plugin that fails while ``"auto"`` weighs the
backends is reported and skipped."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pluggy

from kvcore.errors import PluginError, PluginWarning
from kvcore.memory.layout import KVCacheLayout, parse_layouts
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.manager import blame_wrappers, call_noted, collect_backends, plugin_error
from kvcore.plugins.mixer_backend import MixerBackend
from kvcore.plugins.registry import get_backend, resolve_plugin_manager
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.specs import KVCacheSpec, MultipleOf

#: Spec fields a ``kvcore_customize_spec`` answer may change: padding and alignment only.
CUSTOMIZABLE_FIELDS = ("num_head_slots", "page_size_padded", "block_stride_alignment", "state_content_bytes")


def label(backend: type[AttentionBackend]) -> str:
    """A backend's name in messages (its class name when it has none)."""
    return getattr(backend, "name", None) or backend.__qualname__


def key_of(spec: Any) -> Any:
    """``spec`` as a dict key (an unhashable spec by identity)."""
    try:
        hash(spec)
    except TypeError:
        return ("unhashable", id(spec))
    return spec


def check_sizes(value: Any) -> list[int | MultipleOf]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of int or MultipleOf, got {value!r}")
    if not value:
        raise ValueError("expected at least one size, got an empty list (return None for a backend the plugin "
                         "does not own)")
    for size in value:
        positive = isinstance(size, int) and not isinstance(size, bool) and size > 0
        if not (positive or isinstance(size, MultipleOf)):
            raise TypeError(f"expected positive ints or MultipleOf in the list, got {size!r} in {value!r}")
    return list(value)


def _instance_of(cls: type, what: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, cls):
            raise TypeError(f"expected {what}, got {value!r}")
        return value

    return check


def _check_customized(original: KVCacheSpec, value: Any, backend: str) -> KVCacheSpec:
    allowed = f"a customize hook may only pad or align a spec ({', '.join(CUSTOMIZABLE_FIELDS)})"
    if not isinstance(value, KVCacheSpec):
        raise TypeError(f"expected a KVCacheSpec, got {value!r}")
    if type(value) is not type(original):
        raise TypeError(f"for backend {backend!r} it changed the spec class from {type(original).__name__} to "
                        f"{type(value).__name__}; {allowed}")
    changed = [f"{f.name} from {getattr(original, f.name)!r} to {getattr(value, f.name)!r}"
               for f in attrs.fields(type(original))
               if f.name not in CUSTOMIZABLE_FIELDS and getattr(original, f.name) != getattr(value, f.name)]
    if changed:
        raise ValueError(f"for backend {backend!r} it changed {'; '.join(changed)}, which changes what the layer "
                         f"stores; {allowed}: return attrs.evolve(spec, num_head_slots=...) or similar, or None")
    return value


def call_first(pm: pluggy.PluginManager, hook_name: str, check: Callable[[Any], Any], *,
               unhealthy: dict[str, PluginError] | None = None, **kwargs: Any) -> Any:
    """Call a firstresult hook; ``check`` validates a non-None answer (a refusal names the plugin
    whose own answer it is, else the wrapper that changed it). With ``unhealthy`` (plugin name ->
    its error), a plugin that fails about another plugin's backend is reported, noted there and
    left out, and the hook asked again without it."""
    skip = [pm.get_plugin(name) for name in unhealthy or ()]
    caller = pm.subset_hook_caller(hook_name, skip) if skip else getattr(pm.hook, hook_name)
    try:
        return _checked_first(pm, caller, check, kwargs)
    except PluginError as err:
        culprit, backend = getattr(err, "plugin_name", None), kwargs.get("backend")
        found = collect_backends(pm).entries.get(getattr(backend, "name", None), [])
        owner = found[0][1] if len(found) == 1 and found[0][0] is backend else None
        if unhealthy is None or culprit is None or owner in (None, culprit):
            raise
        unhealthy[culprit] = err
        warnings.warn(f"{err} (kvcore skips that plugin here)", PluginWarning, stacklevel=3)
        return call_first(pm, hook_name, check, unhealthy=unhealthy, **kwargs)


def _checked_first(pm: pluggy.PluginManager, caller: pluggy.HookCaller, check: Callable[[Any], Any],
                   kwargs: dict[str, Any]) -> Any:
    result, turns = call_noted(pm, caller, kwargs)
    if result is None:
        return None
    try:
        return check(result)
    except (TypeError, ValueError) as exc:
        # NOTE: pluggy stops at the first answer; a wrapper may have replaced it since.
        first = next((turn for turn in turns if turn.answer is not None), None)
        if first is not None and (first.answer is result or _refuses(check, first.answer)):
            owner, note = first.plugin_name, ""
        else:
            owner, note = blame_wrappers(caller, "changed by")
        raise plugin_error(pm, owner, caller.name, f"returned a wrong value ({exc}){note}") from exc


def _refuses(check: Callable[[Any], Any], answer: Any) -> bool:
    try:
        check(answer)
    except (TypeError, ValueError):
        return True
    return False


class Refused(str):
    """Why a candidate (a layout, a kernel block size) cannot be used: a value, not an exception."""


#: Hooks ``"auto"`` asks of every backend: a plugin failing on another plugin's backend is skipped.
ISOLATED = ("kvcore_kernel_requirements", "kvcore_backend_priority")


class HookAnswers:
    """Every hook answer one negotiation needs, each asked once per (backend, spec)."""

    def __init__(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        self.pm = resolve_plugin_manager(plugin_manager)
        self._kept: dict[tuple[Any, ...], Any] = {}
        #: key_of(customized spec) -> the backend whose customize hook padded its page
        self.padded_by: dict[Any, str] = {}
        #: plugin name -> the error that made this negotiation skip it (see ``ISOLATED``)
        self.unhealthy: dict[str, PluginError] = {}
        self._alive: list[Any] = []  # NOTE: keeps unhashable specs alive while their id is a key

    def backend(self, backend: type[AttentionBackend] | str) -> type[AttentionBackend]:
        if isinstance(backend, str):
            return get_backend(backend, self.pm)
        if isinstance(backend, type) and issubclass(backend, (AttentionBackend, MixerBackend)):
            return backend
        raise TypeError(f"expected an AttentionBackend subclass or a registered backend name, got {backend!r}")

    def asked(self, hook: str, backend: type, spec: Any, *more: Any) -> Any:
        """What ``hook`` answered for ``backend`` and ``spec`` in this negotiation (None: not asked)."""
        return self._kept.get((hook, backend, key_of(spec), *more))

    def _ask(self, hook: str, check: Callable[[Any], Any], default: Any, backend: type, spec: Any, **more: Any) -> Any:
        key = (hook, backend, key_of(spec), *more.values())
        if key not in self._kept:
            self._alive.append(spec)
            unhealthy = self.unhealthy if hook in ISOLATED else None
            found = call_first(self.pm, hook, check, unhealthy=unhealthy, backend=backend, spec=spec, **more)
            self._kept[key] = default if found is None else found
        return self._kept[key]

    def kernel_block_sizes(self, backend: type, spec: Any) -> list[int | MultipleOf]:
        return self._ask("kvcore_supported_kernel_block_sizes", check_sizes, [MultipleOf(1)], backend, spec)

    def preferred_block_size(self, backend: type, spec: Any) -> int | None:
        """The first ``int`` of the backend's kernel block sizes: the size it prefers (None: no preference)."""
        return next((s for s in self.kernel_block_sizes(backend, spec) if isinstance(s, int)), None)

    def stated_layouts(self, backend: type, spec: Any) -> list[KVCacheLayout] | None:
        return self._ask("kvcore_supported_layouts", parse_layouts, None, backend, spec)

    def requirements(self, backend: type, spec: Any) -> KernelRequirements:
        check = _instance_of(KernelRequirements, "a kvcore.KernelRequirements")
        return self._ask("kvcore_kernel_requirements", check, NO_REQUIREMENTS, backend, spec)

    def priority(self, backend: type, spec: Any, device: Any) -> int:
        check = _instance_of(int, "an int priority")
        return self._ask("kvcore_backend_priority", check, 0, backend, spec, device=device)

    def customized_spec(self, backend: type[AttentionBackend], spec: KVCacheSpec) -> KVCacheSpec:
        """The hook's answer, aligned to ``MultipleOf(max(sizes))`` when every size is an int."""
        key = ("customized", backend, key_of(spec))
        if key in self._kept:
            return self._kept[key]
        check = functools.partial(_check_customized, spec, backend=label(backend))
        new = self._ask("kvcore_customize_spec", check, spec, backend, spec)
        padded = new.page_size_padded is not None and new.page_size_padded != spec.page_size_padded
        if new.is_attention and new.block_stride_alignment is None:
            sizes = self.kernel_block_sizes(backend, new)
            if not any(isinstance(s, MultipleOf) for s in sizes):
                new = attrs.evolve(new, block_stride_alignment=MultipleOf(max(sizes)))
                sizes_key = ("kvcore_supported_kernel_block_sizes", backend, key_of(new))
                self._kept.setdefault(sizes_key, sizes)
        if padded:
            self.padded_by[key_of(new)] = label(backend)
        self._alive.append(new)
        self._kept[key] = new
        return new

    def common_layouts(self, pairs: Sequence[tuple[type, Any]]) -> list[KVCacheLayout] | None:
        """Layouts every (backend, spec) reads, in the first choosy backend's order (None: any)."""
        stated = [(label(b), self.stated_layouts(b, s)) for b, s in pairs]
        lists = [ls for _, ls in stated if ls is not None]
        if not lists:
            return None
        common = [layout for layout in lists[0] if all(layout in ls for ls in lists[1:])]
        if not common:
            offered = "; ".join(f"{b}: [{', '.join(x.name for x in ls)}]" for b, ls in stated if ls is not None)
            raise ValueError(f"the backends share no KV cache layout: {offered}. Serve these layers with backends "
                             "that agree on a layout.")
        return common
