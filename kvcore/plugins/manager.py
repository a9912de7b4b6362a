"""kvcore's plugin manager: hook calls that always name the plugin at fault.

pluggy alone reports neither which plugin raised nor which one returned
nonsense. kvcore therefore calls hook implementations itself, in pluggy's
order (``tryfirst`` first, then the most recently registered, ``trylast``
last), and wraps every failure in a :class:`~kvcore.errors.PluginError`
naming the plugin, its entry point and distribution, and the hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import pluggy

from kvcore.plugins import hookspecs
from kvcore.plugins.backend import AttentionBackend
from kvcore.errors import PluginError

logger = logging.getLogger("kvcore.plugins")

STATUSES = ("loaded", "failed", "blocked", "disabled")


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
        self._backends: dict[str, tuple[type[AttentionBackend], str]] | None = None
        super().register(hookspecs.CoreDefaults(), name=hookspecs.CORE_PLUGIN_NAME)

    # NOTE: any (un)registration may change which backends exist.
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self._backends = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._backends = None
        return super().unregister(plugin, name)


def describe_plugin(pm: pluggy.PluginManager, plugin_name: str) -> str:
    """A label naming a plugin, its entry point, distribution and version."""
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        return pm.plugin_infos[plugin_name].describe()
    plugin = pm.get_plugin(plugin_name)
    label = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    return f"plugin {label!r} (registered in-process as {plugin_name!r})"


def plugin_error(
    pm: pluggy.PluginManager, plugin_name: str, hook_name: str, problem: str
) -> PluginError:
    """A PluginError naming the plugin and hook; ``error.plugin_name`` is set."""
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        remedy = f"fix or uninstall the plugin, or skip it with KVCORE_BLOCK_PLUGINS={plugin_name}"
    else:
        remedy = "fix the plugin or unregister it"
    err = PluginError(f"{describe_plugin(pm, plugin_name)} {problem} in hook {hook_name}; {remedy}")
    err.plugin_name = plugin_name  # type: ignore[attr-defined]
    return err


def _impls(pm: pluggy.PluginManager, hook_name: str) -> list[Any]:
    """Non-wrapper implementations of a hook, in registration order."""
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    return [i for i in impls if not (i.hookwrapper or i.wrapper)]


def _call_impl(pm: pluggy.PluginManager, impl: Any, hook_name: str, kwargs: dict[str, Any]) -> Any:
    try:
        result = impl.function(*[kwargs[a] for a in impl.argnames])
    except PluginError:
        raise
    except Exception as exc:
        raise plugin_error(
            pm, impl.plugin_name, hook_name, f"raised {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(pm, KVCorePluginManager) and pm.trace_calls:
        logger.debug("%s(%s) -> %s returned %r", hook_name, kwargs, impl.plugin_name, result)
    return result


def call_first(
    pm: pluggy.PluginManager,
    hook_name: str,
    check: Callable[[Any], Any],
    **kwargs: Any,
) -> Any:
    """Call a firstresult hook; ``check`` validates and normalizes the answer.

    ``check`` raises ``TypeError``/``ValueError`` describing what was expected;
    that becomes a PluginError naming the plugin that answered.
    """
    for impl in reversed(_impls(pm, hook_name)):
        result = _call_impl(pm, impl, hook_name, kwargs)
        if result is None:
            continue
        try:
            return check(result)
        except (TypeError, ValueError) as exc:
            raise plugin_error(
                pm, impl.plugin_name, hook_name, f"returned a wrong value ({exc})"
            ) from exc
    return None


def collect_backends(pm: pluggy.PluginManager) -> dict[str, tuple[type[AttentionBackend], str]]:
    """Backend name -> (class, registering plugin name), from every plugin.

    Plugins are asked in registration order, so a later plugin registering a
    name already taken is the one refused.
    """
    if isinstance(pm, KVCorePluginManager) and pm._backends is not None:
        return pm._backends
    hook_name = "kvcore_register_backends"
    found: dict[str, tuple[type[AttentionBackend], str]] = {}
    for impl in _impls(pm, hook_name):
        owner = impl.plugin_name

        def register(backend: Any, _owner: str = owner) -> None:
            _add_backend(pm, found, backend, _owner, hook_name)

        _call_impl(pm, impl, hook_name, {"register": register})
    if isinstance(pm, KVCorePluginManager):
        pm._backends = found
    return found


def _add_backend(
    pm: pluggy.PluginManager,
    found: dict[str, tuple[type[AttentionBackend], str]],
    backend: Any,
    owner: str,
    hook_name: str,
) -> None:
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise plugin_error(
            pm, owner, hook_name,
            f"registered {backend!r}, which is not a kvcore.AttentionBackend subclass",
        )
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        raise plugin_error(
            pm, owner, hook_name,
            f"registered {backend.__qualname__} without a str class attribute 'name'",
        )
    if name in found:
        other_cls, other = found[name]
        if other_cls is backend and other == owner:
            return
        raise plugin_error(
            pm, owner, hook_name,
            f"registered backend name {name!r}, already registered by "
            f"{describe_plugin(pm, other)}; the two plugins clash",
        )
    found[name] = (backend, owner)
