"""kvcore's plugin manager: pluggy's own dispatch, with errors that name the plugin.

Every hook call goes through pluggy (``tryfirst``/``trylast`` order,
``firstresult``, ``hookwrapper=True`` and ``wrapper=True`` wrappers). pluggy
alone names no plugin when an implementation raises or answers nonsense, so
kvcore adds the name: an exception is attributed to the deepest hook
implementation in its traceback; a refused answer to the implementation that
gave it. Either way the :class:`~kvcore.errors.PluginError` names the
plugin, its entry point and distribution, and the hook.
"""

from __future__ import annotations

import logging
import sys
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
    """A pluggy manager for project "kvcore" that remembers where plugins came from."""

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

    # NOTE: any (un)registration may change which backends exist.
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self._backends = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._backends = None
        return super().unregister(plugin, name)


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


def _impl_codes(caller: pluggy.HookCaller) -> dict[int, str]:
    """``id`` of every implementation's code object -> its plugin name.

    NOTE: by identity, since code objects of equal source in two files compare equal.
    """
    out: dict[int, str] = {}
    for impl in caller.get_hookimpls():
        function = getattr(impl.function, "__func__", impl.function)
        code = getattr(function, "__code__", None)
        if code is not None:
            out[id(code)] = impl.plugin_name
    return out


def _raising_plugin(caller: pluggy.HookCaller, tb: types.TracebackType | None) -> str | None:
    """The plugin whose implementation is deepest in ``tb`` (where the error arose)."""
    codes, found = _impl_codes(caller), None
    while tb is not None:
        found = codes.get(id(tb.tb_frame.f_code), found)
        tb = tb.tb_next
    return found


def calling_plugin(caller: pluggy.HookCaller) -> str | None:
    """The plugin whose implementation of ``caller``'s hook is running on this stack."""
    codes = _impl_codes(caller)
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame.f_code) in codes:
            return codes[id(frame.f_code)]
        frame = frame.f_back
    return None


def call_hook(
    pm: pluggy.PluginManager, hook_name: str, caller: pluggy.HookCaller | None = None, **kwargs: Any
) -> Any:
    """Call a hook through pluggy (wrappers honoured); a raising plugin is named."""
    caller = getattr(pm.hook, hook_name) if caller is None else caller
    try:
        result = caller(**kwargs)
    except PluginError:
        raise
    except Exception as exc:
        owner = _raising_plugin(caller, exc.__traceback__)
        raise plugin_error(pm, owner, hook_name, f"raised {type(exc).__name__}: {exc}") from exc
    if isinstance(pm, KVCorePluginManager) and pm.trace_calls:
        asked = [i.plugin_name for i in reversed(caller.get_hookimpls())]
        logger.debug("%s(%s) asked %s -> %r", hook_name, kwargs, asked, result)
    return result


def _answering_plugin(
    caller: pluggy.HookCaller, kwargs: dict[str, Any], check: Callable[[Any], Any]
) -> tuple[str | None, str]:
    """``(plugin, note)``: who gave a refused answer (asked again only on this error path).

    The first non-None answer in pluggy's order is the one the hook returned;
    if that one passes ``check``, a wrapper changed it: with one wrapper that
    one is named, else ``note`` lists them.
    """
    impls = list(reversed(caller.get_hookimpls()))
    for impl in impls:
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            answer = impl.function(*[kwargs[a] for a in impl.argnames])
        except Exception:
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
    caller = getattr(pm.hook, hook_name)
    result = call_hook(pm, hook_name, caller, **kwargs)
    if result is None:
        return None
    try:
        return check(result)
    except (TypeError, ValueError) as exc:
        owner, note = _answering_plugin(caller, kwargs, check)
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


def collect_backends(pm: pluggy.PluginManager, caller: pluggy.HookCaller | None = None) -> BackendTable:
    """Ask ``kvcore_register_backends`` (all plugins, or ``caller``'s subset) once.

    ``register`` knows which plugin calls it (the implementation on the
    stack) and checks the class: an AttentionBackend subclass with a non-empty
    str ``name`` that implements ``forward``. Two plugins registering one
    name make it ambiguous (both kept, neither served); never "first wins".
    """
    full = caller is None
    if full and isinstance(pm, KVCorePluginManager) and pm._backends is not None:
        return pm._backends
    hook_name = "kvcore_register_backends"
    caller = getattr(pm.hook, hook_name) if caller is None else caller
    entries: dict[str, list[tuple[type[AttentionBackend], str]]] = {}

    def register(backend: Any) -> None:
        owner = calling_plugin(caller)
        if owner is None:
            raise PluginError(
                f"register({backend!r}) was called outside {hook_name}; call it from "
                "your plugin's kvcore_register_backends implementation"
            )
        _check_backend(pm, backend, owner, hook_name)
        found = entries.setdefault(backend.name, [])
        if (backend, owner) in found:
            return
        if any(other == owner for _, other in found):
            raise plugin_error(
                pm, owner, hook_name, f"registered two classes named {backend.name!r}"
            )
        found.append((backend, owner))

    call_hook(pm, hook_name, caller, register=register)
    table = BackendTable(entries)
    if full and isinstance(pm, KVCorePluginManager):
        pm._backends = table
    return table


def _check_backend(pm: pluggy.PluginManager, backend: Any, owner: str, hook_name: str) -> None:
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise plugin_error(
            pm, owner, hook_name,
            f"registered {backend!r}, which is not a kvcore.AttentionBackend subclass",
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        raise plugin_error(
            pm, owner, hook_name,
            f"registered {backend.__qualname__} without a non-empty str class attribute 'name'",
        )
    if not implements_forward(backend):
        raise plugin_error(
            pm, owner, hook_name,
            f"registered {backend.__qualname__} ({name!r}), which does not implement "
            "forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, "
            "sliding_window=None, out=None)",
        )
