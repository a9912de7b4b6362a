"""kvcore's plugin manager: pluggy's own dispatch, with errors that name the plugin.

Every hook call goes through pluggy (call order, ``firstresult``, both kinds of
wrappers). The plugin at fault is named from ``get_hookimpls()``: an exception
after the deepest implementation in its traceback; a refused answer after the
implementation that gave it (each asked alone through a pluggy subset caller,
on that error path only); a registered backend after the plugin whose
``kvcore_register_backends`` runs (each through its own subset caller).
"""

from __future__ import annotations

import functools
import logging
import types
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


def _raising_plugin(caller: pluggy.HookCaller, tb: types.TracebackType | None) -> str | None:
    """The plugin whose implementation (``get_hookimpls()``) is deepest in the exception's traceback."""
    # NOTE: code objects by identity: two of equal source in two files compare equal.
    codes = {id(getattr(getattr(i.function, "__func__", i.function), "__code__", None)): i.plugin_name
             for i in caller.get_hookimpls()}
    found = None
    while tb is not None:
        found = codes.get(id(tb.tb_frame.f_code), found)
        tb = tb.tb_next
    return found


def call_hook(
    pm: pluggy.PluginManager, hook_name: str, caller: pluggy.HookCaller | None = None, **kwargs: Any
) -> Any:
    """Call a hook through pluggy (wrappers honoured); a raising plugin is named."""
    caller = getattr(pm.hook, hook_name) if caller is None else caller
    try:
        return caller(**kwargs)
    except PluginError:
        raise
    except Exception as exc:
        owner = _raising_plugin(caller, exc.__traceback__)
        raise plugin_error(pm, owner, hook_name, f"raised {type(exc).__name__}: {exc}") from exc


def _alone(pm: pluggy.PluginManager, hook_name: str, impl: pluggy.HookImpl, keep_wrappers: bool) -> pluggy.HookCaller:
    """``hook_name``'s caller with only ``impl`` (and, if asked, the wrappers) left: a pluggy subset caller."""
    others = [i.plugin for i in getattr(pm.hook, hook_name).get_hookimpls()
              if i is not impl and not (keep_wrappers and (i.wrapper or i.hookwrapper))]
    return pm.subset_hook_caller(hook_name, others)


def _answering_plugin(
    pm: pluggy.PluginManager, hook_name: str, kwargs: dict[str, Any], check: Callable[[Any], Any]
) -> tuple[str | None, str]:
    """``(plugin, note)``: who gave a refused answer (asked again, through pluggy, on this error path only).

    Each implementation is asked alone, in pluggy's order, until one answers:
    if that answer is refused too, it is the culprit; else a wrapper changed
    it: with one wrapper that one is named, else ``note`` lists them.
    """
    impls = list(reversed(getattr(pm.hook, hook_name).get_hookimpls()))
    for impl in impls:
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            answer = _alone(pm, hook_name, impl, keep_wrappers=False)(**kwargs)
        except Exception:  # noqa: BLE001 - this one raises now: not the answer being traced
            continue
        if answer is None:
            continue
        try:
            check(answer)
        except (TypeError, ValueError):
            return impl.plugin_name, ""
        break
    wrappers = [i.plugin_name for i in impls if i.hookwrapper or i.wrapper]
    if len(wrappers) == 1:
        return wrappers[0], ""
    return None, f" (changed by one of the wrappers of plugins {wrappers})"


def call_first(pm: pluggy.PluginManager, hook_name: str, check: Callable[[Any], Any], **kwargs: Any) -> Any:
    """Call a firstresult hook; ``check`` validates and normalizes a non-None answer.

    ``check`` raises ``TypeError``/``ValueError`` describing what was expected;
    that becomes a PluginError naming the plugin that answered.
    """
    result = call_hook(pm, hook_name, **kwargs)
    if result is None:
        return None
    try:
        return check(result)
    except (TypeError, ValueError) as exc:
        owner, note = _answering_plugin(pm, hook_name, kwargs, check)
        raise plugin_error(pm, owner, hook_name, f"returned a wrong value ({exc}){note}") from exc


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
            call_hook(pm, hook_name, _alone(pm, hook_name, impl, keep_wrappers=True),
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
