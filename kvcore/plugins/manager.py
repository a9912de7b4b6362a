"""kvcore's pluggy manager: hook calls that name the plugin at fault (each plain implementation
takes part through pluggy's ``call_extra``, noted under its ``HookImpl.plugin_name``; the answers
asked of backends are checked in answers.py), and the registered backends."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import attrs
import pluggy

from kvcore.errors import PluginError
from kvcore.plugins import hookspecs
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.mixer_backend import is_mixer_backend, mixer_problem

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
    kernel_block_sizes: dict[str, list[int | dict[str, int]]] = attrs.field(factory=dict)
    layouts: dict[str, list[str] | None] = attrs.field(factory=dict)

    def describe(self) -> str:
        """The plugin in messages: entry point, distribution and version."""
        if self.entry_point is None:
            return f"plugin {self.name!r} (registered in-process)"
        return (f"plugin {self.name!r} (entry point '{self.entry_point}' of "
                f"distribution {self.distribution or '?'} {self.version or '?'})")

    def flag(self, status: str, message: str) -> None:
        self.status = status
        if message not in (self.error or ""):
            self.error = "; ".join(filter(None, [self.error, message]))

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class KVCorePluginManager(pluggy.PluginManager):
    """A pluggy manager for project "kvcore" that remembers where plugins came from."""

    def __init__(self, *, trace_calls: bool = False) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
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
            self.add_hookcall_monitoring(
                lambda hook, impls, kwargs: logger.debug(
                    "%s(%s) asks %s", hook, kwargs,
                    [getattr(i.function, "kvcore_plugin_name", i.plugin_name) for i in reversed(impls)],
                ),
                lambda outcome, hook, impls, kwargs: logger.debug(
                    "%s -> %r", hook, outcome.exception or outcome.get_result()
                ),
            )

    # NOTE: any (un)registration may change which backends exist.
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self._backends = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._backends = None
        return super().unregister(plugin, name)


def describe_plugin(pm: pluggy.PluginManager, plugin_name: str | None) -> str:
    if plugin_name is None:
        return "a hook implementation"
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        return pm.plugin_infos[plugin_name].describe()
    plugin = pm.get_plugin(plugin_name)
    label = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    return f"plugin {label!r} (registered in-process as {plugin_name!r})"


def plugin_error(pm: pluggy.PluginManager, plugin_name: str | None, hook_name: str, problem: str) -> PluginError:
    if isinstance(pm, KVCorePluginManager) and plugin_name in pm.plugin_infos:
        remedy = f"fix or uninstall the plugin, or skip it with KVCORE_BLOCK_PLUGINS={plugin_name}"
    else:
        remedy = "fix the plugin or unregister it"
    err = PluginError(f"{describe_plugin(pm, plugin_name)} {problem} in hook {hook_name}; {remedy}")
    err.plugin_name = plugin_name  # type: ignore[attr-defined]
    return err


def conflict_message(pm: pluggy.PluginManager, name: str, owners: list[str]) -> str:
    return (
        f"attention backend {name!r} is registered by "
        + " and by ".join(describe_plugin(pm, owner) for owner in owners)
        + f"; kvcore uses none of them. Keep one: block the others with "
        f"KVCORE_BLOCK_PLUGINS={','.join(owners[1:])} (or another choice), or uninstall them"
    )


class _Turn(NamedTuple):
    """One plain hook implementation's turn in a call kvcore made: its answer or its exception."""

    plugin_name: str
    answer: Any = None
    error: BaseException | None = None


def _noting(impl: Any, turns: list[_Turn]) -> Callable[..., Any]:
    """``impl``'s function, noting its turn (pluggy reads the parameters through ``__wrapped__``)."""

    @functools.wraps(impl.function)
    def noted(*args: Any) -> Any:
        try:
            answer = impl.function(*args)
        except BaseException as exc:
            turns.append(_Turn(impl.plugin_name, error=exc))
            raise
        turns.append(_Turn(impl.plugin_name, answer=answer))
        return answer

    noted.kvcore_plugin_name = impl.plugin_name  # type: ignore[attr-defined]  # NOTE: for the trace
    return noted


def blame_wrappers(caller: pluggy.HookCaller, what: str) -> tuple[str | None, str]:
    """The one wrapper when no plain implementation is at fault, else a note naming them all."""
    impls = reversed(caller.get_hookimpls())
    wrappers = [i.plugin_name for i in impls if i.wrapper or i.hookwrapper]
    if len(wrappers) == 1:
        return wrappers[0], ""
    return None, f" ({what} one of the wrappers of plugins {wrappers})" if wrappers else ""


def call_noted(
    pm: pluggy.PluginManager, caller: pluggy.HookCaller, kwargs: dict[str, Any], only: Sequence[Any] | None = None
) -> tuple[Any, list[_Turn]]:
    """``caller(**kwargs)`` with the wrappers around it (only the plain implementations ``only``,
    None: all), each plain implementation taking part through ``call_extra`` in its own place so
    that its answer or exception is noted under its name; an exception names its plugin."""
    every = getattr(pm.hook, caller.name).get_hookimpls()
    wrappers_only = pm.subset_hook_caller(caller.name, [i.plugin for i in every if not (i.wrapper or i.hookwrapper)])
    plain = [i for i in caller.get_hookimpls() if not (i.wrapper or i.hookwrapper) and (only is None or i in only)]
    turns: list[_Turn] = []
    try:
        return wrappers_only.call_extra([_noting(i, turns) for i in plain], kwargs), turns
    except PluginError:
        raise
    except Exception as exc:
        raised = [turn.plugin_name for turn in turns if turn.error is exc]
        owner, note = (raised[0], "") if raised else blame_wrappers(caller, "raised in")
        problem = f"raised {type(exc).__name__}: {exc}{note}"
        raise plugin_error(pm, owner, caller.name, problem) from exc


@attrs.frozen
class BackendTable:
    """Every registered backend: name -> ``[(class, plugin), ...]`` (several: ambiguous, unused)."""

    entries: dict[str, list[tuple[type[AttentionBackend], str]]]

    def unambiguous(self) -> dict[str, tuple[type[AttentionBackend], str]]:
        return {name: found[0] for name, found in self.entries.items() if len(found) == 1}

    def conflicts(self) -> dict[str, list[tuple[type[AttentionBackend], str]]]:
        return {name: found for name, found in self.entries.items() if len(found) > 1}


_REGISTER = "kvcore_register_backends"


def collect_backends(pm: pluggy.PluginManager, only: str | None = None) -> BackendTable:
    """Ask every plugin's (or plugin ``only``'s) ``kvcore_register_backends`` once, through pluggy,
    with a ``register`` that knows the plugin and checks the class."""
    full = only is None and isinstance(pm, KVCorePluginManager)
    if full and pm._backends is not None:
        return pm._backends
    entries: dict[str, list[tuple[type[AttentionBackend], str]]] = {}
    calling: set[str] = set()  # NOTE: the plugin whose implementation runs now

    def register(backend: Any, owner: str) -> None:
        if owner not in calling:
            raise PluginError(f"register({backend!r}) was called after {_REGISTER} returned; "
                              f"call it from your plugin's {_REGISTER} implementation")
        _check_backend(pm, backend, owner)
        found = entries.setdefault(backend.name, [])
        if any(other == owner and cls is not backend for cls, other in found):
            problem = f"registered two classes named {backend.name!r}"
            raise plugin_error(pm, owner, _REGISTER, problem)
        if (backend, owner) not in found:
            found.append((backend, owner))

    hook = getattr(pm.hook, _REGISTER)
    plain = [i for i in hook.get_hookimpls() if not (i.wrapper or i.hookwrapper)]
    for impl in reversed(plain):
        if only in (None, impl.plugin_name):
            calling.add(impl.plugin_name)
            # NOTE: one plugin at a time (its wrappers around it), so register knows the caller.
            try:
                call_noted(pm, hook, {"register": functools.partial(register, owner=impl.plugin_name)}, [impl])
            finally:
                calling.discard(impl.plugin_name)
    table = BackendTable(entries)
    if full:
        pm._backends = table
    return table


def _check_backend(pm: pluggy.PluginManager, backend: Any, owner: str) -> None:
    mixer = is_mixer_backend(backend)
    if not (mixer or (isinstance(backend, type) and issubclass(backend, AttentionBackend))):
        problem = f"registered {backend!r}, not a kvcore.AttentionBackend subclass (nor a MixerBackend)"
    elif not isinstance(getattr(backend, "name", None), str) or not backend.name:
        problem = (f"registered {backend.__qualname__} without a non-empty str class attribute 'name'")
    elif mixer:
        problem = mixer_problem(backend)
        if problem is None:
            return
    elif inspect.getattr_static(backend, "forward") is AttentionBackend.__dict__["forward"]:
        problem = (f"registered {backend.__qualname__} ({backend.name!r}), which does not implement forward(query, "
                   "key, value, kv_cache_view, metadata, *, head_size, scale, sliding_window=None, out=None)")
    else:
        return
    raise plugin_error(pm, owner, _REGISTER, problem)
