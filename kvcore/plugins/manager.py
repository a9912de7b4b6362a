"""kvcore's plugin manager: pluggy's own dispatch, with errors that name the plugin.

Every hook call goes through pluggy (call order, ``firstresult``, both kinds of
wrappers). The plugin at fault is named from pluggy's own ``HookImpl.plugin_name``
(``get_hookimpls()``): during kvcore's calls each implementation notes what it
answered or raised as pluggy calls it, so an exception or a refused answer is
put on the implementation that produced it (else on the wrappers) without
calling any plugin again; a registered backend is credited to the plugin whose
``kvcore_register_backends`` runs (each through its own subset caller).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable
from typing import Any

import attrs
import pluggy

from kvcore.errors import PluginError
from kvcore.plugins import hookspecs
from kvcore.plugins.backend import AttentionBackend, implements_forward

logger = logging.getLogger("kvcore.plugins")

STATUSES = ("loaded", "failed", "conflict", "unhealthy", "blocked", "disabled")


@attrs.define
class PluginInfo:
    """What ``kvcore plugins`` shows about one plugin."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None
    status: str = attrs.field(default="loaded", validator=attrs.validators.in_(STATUSES))
    error: str | None = None
    hooks: list[str] = attrs.field(factory=list)
    backends: list[str] = attrs.field(factory=list)
    #: backend -> its declared kernel block sizes / layouts (filled by the health check)
    kernel_block_sizes: dict[str, list[int | str]] = attrs.field(factory=dict)
    layouts: dict[str, list[str] | None] = attrs.field(factory=dict)

    def describe(self) -> str:
        if self.entry_point is None:
            return f"plugin {self.name!r} (registered in-process)"
        return (
            f"plugin {self.name!r} (entry point '{self.entry_point}' of distribution "
            f"{self.distribution or '?'} {self.version or '?'})"
        )

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class KVCorePluginManager(pluggy.PluginManager):
    """A pluggy manager for project "kvcore" that remembers where plugins came from.

    ``trace_calls``: every hook call is logged at DEBUG on logger ``kvcore.plugins`` (pluggy's
    hook-call monitoring: the hook, the plugins asked in order, the arguments and the result).
    """

    def __init__(self, *, trace_calls: bool = False) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.trace_calls = trace_calls
        #: entry-point name -> info, for every entry point seen (loaded or not)
        self.plugin_infos: dict[str, PluginInfo] = {}
        #: what the settings asked for that no entry point provides (say ``KVCORE_PLUGINS=typo``)
        self.settings_problems: list[str] = []
        self._backends: BackendTable | None = None
        super().register(hookspecs.CoreDefaults(), name=hookspecs.CORE_PLUGIN_NAME)
        if trace_calls:
            logger.setLevel(logging.DEBUG)
            if not logger.handlers and not logging.getLogger().handlers:
                logger.addHandler(logging.StreamHandler())
            self.add_hookcall_monitoring(_trace_before, _trace_after)

    # NOTE: any (un)registration may change which backends exist.
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self._backends = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._backends = None
        return super().unregister(plugin, name)


def _trace_before(hook_name: str, impls: list[pluggy.HookImpl], kwargs: dict[str, Any]) -> None:
    logger.debug("%s(%s) asks %s", hook_name, kwargs, [i.plugin_name for i in reversed(impls)])


def _trace_after(outcome: pluggy.Result, hook_name: str, impls: list[pluggy.HookImpl], kwargs: dict[str, Any]) -> None:
    logger.debug("%s -> %r", hook_name, outcome.exception or outcome.get_result())


def describe_plugin(pm: pluggy.PluginManager, plugin_name: str | None) -> str:
    """A label naming a plugin, its entry point, distribution and version."""
    if plugin_name is None:
        return "a hook implementation"
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        return pm.plugin_infos[plugin_name].describe()
    plugin = pm.get_plugin(plugin_name)
    label = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    return f"plugin {label!r} (registered in-process as {plugin_name!r})"


def plugin_error(
    pm: pluggy.PluginManager, plugin_name: str | None, hook_name: str, problem: str
) -> PluginError:
    """A PluginError naming the plugin and hook; ``error.plugin_name`` is set."""
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        remedy = f"fix or uninstall the plugin, or skip it with KVCORE_BLOCK_PLUGINS={plugin_name}"
    else:
        remedy = "fix the plugin or unregister it"
    err = PluginError(f"{describe_plugin(pm, plugin_name)} {problem} in hook {hook_name}; {remedy}")
    err.plugin_name = plugin_name  # type: ignore[attr-defined]
    return err


@attrs.frozen
class _Event:
    """One hook implementation's turn in a call kvcore made: its answer (None: none) or its exception."""

    plugin_name: str
    answer: Any = None
    error: BaseException | None = None


#: The turns taken in the hook call kvcore is making now (None outside kvcore's calls).
_EVENTS: contextvars.ContextVar[list[_Event] | None] = contextvars.ContextVar("kvcore_hook_events", default=None)


class _Noting:
    """A hook implementation's function that, inside kvcore's calls, notes what it answered or raised.

    pluggy calls it in its own order (wrappers, ``firstresult`` and all), so the
    plugin at fault is named from what happened, without calling plugin code again.
    """

    __slots__ = ("function", "plugin_name")

    def __init__(self, function: Callable[..., Any], plugin_name: str) -> None:
        self.function = function
        self.plugin_name = plugin_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        events = _EVENTS.get()
        if events is None:
            return self.function(*args, **kwargs)
        try:
            answer = self.function(*args, **kwargs)
        except BaseException as exc:
            events.append(_Event(self.plugin_name, error=exc))
            raise
        events.append(_Event(self.plugin_name, answer=answer))
        return answer


def _noted_call(caller: pluggy.HookCaller, kwargs: dict[str, Any], events: list[_Event]) -> Any:
    """``caller(**kwargs)`` through pluggy, each plain implementation's answer or exception noted in ``events``."""
    for impl in caller.get_hookimpls():
        # NOTE: pluggy keeps one HookImpl per implementation; its function is swapped once
        # for a noting one (wrappers are left as they are: their generators pass answers on).
        if not (impl.wrapper or impl.hookwrapper or isinstance(impl.function, _Noting)):
            impl.function = _Noting(impl.function, impl.plugin_name)  # type: ignore[misc]
    token = _EVENTS.set(events)
    try:
        return caller(**kwargs)
    finally:
        _EVENTS.reset(token)


def _by_wrappers(caller: pluggy.HookCaller, what: str) -> tuple[str | None, str]:
    """``(plugin, note)`` when no plain implementation is at fault: the one wrapper, else a note naming them all."""
    wrappers = [i.plugin_name for i in reversed(caller.get_hookimpls()) if i.wrapper or i.hookwrapper]
    if len(wrappers) == 1:
        return wrappers[0], ""
    return None, f" ({what} one of the wrappers of plugins {wrappers})" if wrappers else ""


def call_hook(
    pm: pluggy.PluginManager, hook_name: str, caller: pluggy.HookCaller | None = None, **kwargs: Any
) -> Any:
    """Call a hook through pluggy (wrappers honoured); a raising plugin is named."""
    return _call(pm, hook_name, getattr(pm.hook, hook_name) if caller is None else caller, kwargs, [])


def _call(pm: pluggy.PluginManager, hook_name: str, caller: pluggy.HookCaller, kwargs: dict[str, Any],
          events: list[_Event]) -> Any:
    try:
        return _noted_call(caller, kwargs, events)
    except PluginError:
        raise
    except Exception as exc:
        raised = [e.plugin_name for e in events if e.error is exc]
        owner, note = (raised[0], "") if raised else _by_wrappers(caller, "raised in")
        raise plugin_error(pm, owner, hook_name, f"raised {type(exc).__name__}: {exc}{note}") from exc


def call_first(pm: pluggy.PluginManager, hook_name: str, check: Callable[[Any], Any], **kwargs: Any) -> Any:
    """Call a firstresult hook; ``check`` validates and normalizes a non-None answer.

    ``check`` raises ``TypeError``/``ValueError`` describing what was expected;
    that becomes a PluginError naming the plugin that answered: the
    implementation whose own answer is refused, else the wrapper that changed
    it (with several wrappers, a note lists them).
    """
    caller = getattr(pm.hook, hook_name)
    events: list[_Event] = []
    result = _call(pm, hook_name, caller, kwargs, events)
    if result is None:
        return None
    try:
        return check(result)
    except (TypeError, ValueError) as exc:
        # NOTE: pluggy stops at the first answer; a wrapper may have replaced it since.
        answer = next((e for e in events if e.answer is not None), None)
        if answer is not None and (answer.answer is result or _refused(check, answer.answer)):
            owner, note = answer.plugin_name, ""
        else:
            owner, note = _by_wrappers(caller, "changed by")
        raise plugin_error(pm, owner, hook_name, f"returned a wrong value ({exc}){note}") from exc


def _refused(check: Callable[[Any], Any], answer: Any) -> bool:
    try:
        check(answer)
    except (TypeError, ValueError):
        return True
    return False


def _alone(pm: pluggy.PluginManager, hook_name: str, impl: pluggy.HookImpl) -> pluggy.HookCaller:
    """``hook_name``'s caller with only ``impl`` and the wrappers left: a pluggy subset caller."""
    others = [i.plugin for i in getattr(pm.hook, hook_name).get_hookimpls()
              if i is not impl and not (i.wrapper or i.hookwrapper)]
    return pm.subset_hook_caller(hook_name, others)


@attrs.frozen
class BackendTable:
    """Every registered backend: name -> ``[(class, registering plugin), ...]``.

    A name with more than one entry is ambiguous: kvcore serves none of them.
    """

    entries: dict[str, list[tuple[type[AttentionBackend], str]]]

    def unambiguous(self) -> dict[str, tuple[type[AttentionBackend], str]]:
        return {name: found[0] for name, found in self.entries.items() if len(found) == 1}

    def conflicts(self) -> dict[str, list[tuple[type[AttentionBackend], str]]]:
        return {name: found for name, found in self.entries.items() if len(found) > 1}


def collect_backends(pm: pluggy.PluginManager, only: str | None = None) -> BackendTable:
    """Ask ``kvcore_register_backends`` of every plugin (or of plugin ``only``) once.

    Each implementation is called through pluggy (a subset caller keeping the
    wrappers) with a ``register`` that knows its plugin and checks the class:
    an AttentionBackend subclass with a non-empty str ``name`` that implements
    ``forward``. Two plugins registering one name make it ambiguous (both
    kept, neither served); never "first wins".
    """
    full = only is None
    if full and isinstance(pm, KVCorePluginManager) and pm._backends is not None:
        return pm._backends
    hook_name = "kvcore_register_backends"
    entries: dict[str, list[tuple[type[AttentionBackend], str]]] = {}
    calling: set[str] = set()  # NOTE: the plugin whose implementation runs now

    def register(backend: Any, owner: str) -> None:
        if owner not in calling:
            raise PluginError(f"register({backend!r}) was called after {hook_name} returned; call it from your "
                              f"plugin's {hook_name} implementation")
        _check_backend(pm, backend, owner, hook_name)
        found = entries.setdefault(backend.name, [])
        if any(other == owner and cls is not backend for cls, other in found):
            raise plugin_error(pm, owner, hook_name, f"registered two classes named {backend.name!r}")
        if (backend, owner) not in found:
            found.append((backend, owner))

    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        if impl.wrapper or impl.hookwrapper or not (full or impl.plugin_name == only):
            continue
        calling.add(impl.plugin_name)
        try:
            call_hook(pm, hook_name, _alone(pm, hook_name, impl),
                      register=functools.partial(register, owner=impl.plugin_name))
        finally:
            calling.discard(impl.plugin_name)
    table = BackendTable(entries)
    if full and isinstance(pm, KVCorePluginManager):
        pm._backends = table
    return table


def _check_backend(pm: pluggy.PluginManager, backend: Any, owner: str, hook_name: str) -> None:
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise plugin_error(pm, owner, hook_name, f"registered {backend!r}, not a kvcore.AttentionBackend subclass")
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        raise plugin_error(pm, owner, hook_name,
                           f"registered {backend.__qualname__} without a non-empty str class attribute 'name'")
    if not implements_forward(backend):
        raise plugin_error(pm, owner, hook_name, f"registered {backend.__qualname__} ({name!r}), which does not "
                           "implement forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, "
                           "sliding_window=None, out=None)")
