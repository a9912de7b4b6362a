"""Building the plugin manager from installed entry points (loaded one by one by pluggy, blocked
through ``set_blocked``), and looking backends up."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import warnings

import attrs
import pluggy

from kvcore.errors import PluginError, PluginWarning
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.hookspecs import CORE_PLUGIN_NAME, ENTRY_POINT_GROUP
from kvcore.plugins.manager import BackendTable, KVCorePluginManager, PluginInfo, collect_backends, conflict_message
from kvcore.settings import Settings


def get_plugin_manager(*, autoload: bool = True) -> KVCorePluginManager:
    """A fresh plugin manager: hookspecs, core defaults, then installed plugins (if autoload)."""
    settings = Settings.from_env()
    return build_plugin_manager(attrs.evolve(settings, autoload=autoload and settings.autoload))


def build_plugin_manager(settings: Settings) -> KVCorePluginManager:
    """:func:`get_plugin_manager` with explicit settings instead of the environment."""
    pm = KVCorePluginManager(trace_calls=settings.trace_plugins)
    for name in settings.blocked_plugins:
        pm.set_blocked(name)
    entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(entry_points, key=lambda e: e.name):
        info = PluginInfo(name=ep.name,
                          distribution=None if ep.dist is None else ep.dist.metadata["Name"] or ep.dist.name,
                          version=None if ep.dist is None else ep.dist.version, entry_point=f"{ep.name} = {ep.value}")
        if info.name in pm.plugin_infos:
            other = pm.plugin_infos[info.name].describe()
            _report(f"{info.describe()} is skipped: {other} has that name", settings.strict_plugins)
            continue
        pm.plugin_infos[info.name] = info
        allowed = settings.plugins is None or info.name in settings.plugins
        if not (settings.autoload and allowed):
            info.status = "disabled"
        elif pm.is_blocked(info.name):
            info.status = "blocked"
        else:
            _load(pm, info, settings.strict_plugins)
    missing = sorted((settings.plugins or frozenset()) - set(pm.plugin_infos))
    if settings.autoload and missing:
        pm.settings_problems.append(f"KVCORE_PLUGINS names {missing} but no installed plugin has "
                                    f"that entry point; installed: {sorted(pm.plugin_infos)}")
        _report(pm.settings_problems[-1], strict=False)
    for name, found in collect_backends(pm).conflicts().items():
        _report(conflict_message(pm, name, [owner for _, owner in found]), strict=False)
    return pm


def _report(message: str, strict: bool) -> None:
    if strict:
        raise PluginError(message)
    warnings.warn(message, PluginWarning, stacklevel=4)


def _load(pm: KVCorePluginManager, info: PluginInfo, strict: bool) -> None:
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=info.name)
        try:
            pm.check_pending()  # NOTE: plugins loaded before passed it: a failure is this one's
        except pluggy.PluginValidationError as exc:
            known = sorted(name for name, caller in vars(pm.hook).items() if caller.has_spec())
            raise PluginError(f"{info.describe()}: {exc}; kvcore's hooks are {known}") from exc
        collect_backends(pm, only=info.name)
    except Exception as exc:
        registered = pm.get_plugin(info.name) is not None
        if isinstance(exc, PluginError):
            problem = str(exc)
        elif registered or isinstance(exc, pluggy.PluginValidationError):
            # NOTE: pluggy imports, then registers: a plugin it holds failed registration
            problem = f"{info.describe()} could not be registered: {exc}"
        else:
            problem = (f"{info.describe()} failed to import, so none of its "
                       f"kvcore_* hooks run ({type(exc).__name__}: {exc})")
        if registered:
            pm.unregister(name=info.name)
        info.status, info.error = "failed", problem
        if strict:
            raise PluginError(problem) from exc
        warnings.warn(f"{problem}; skipping it", PluginWarning, stacklevel=3)
        return
    plugin = pm.get_plugin(info.name)
    marked = {c.name for c in pm.get_hookcallers(plugin) or []}
    unmarked = sorted(n for n in dir(plugin) if n.startswith("kvcore_") and n not in marked)
    if unmarked:
        _report(f"{info.describe()} defines {unmarked} without @kvcore.hookimpl; kvcore ignores them", strict=False)
    info.status = "loaded"


@functools.lru_cache(maxsize=1)
def default_plugin_manager() -> KVCorePluginManager:
    """The manager serving ``plugin_manager=None``, built on first use."""
    return get_plugin_manager()


def reset_default_plugin_manager() -> None:
    """Forget the default manager; the next use rebuilds it (reads the environment and the
    installed distributions again: call it after installing a plugin in-process)."""
    importlib.invalidate_caches()
    default_plugin_manager.cache_clear()


def resolve_plugin_manager(plugin_manager: pluggy.PluginManager | None) -> pluggy.PluginManager:
    if plugin_manager is None:
        return default_plugin_manager()
    if not isinstance(plugin_manager, pluggy.PluginManager):
        raise TypeError("plugin_manager must be a pluggy.PluginManager (see "
                        f"kvcore.get_plugin_manager) or None, got {plugin_manager!r}")
    return plugin_manager


def get_backends(plugin_manager: pluggy.PluginManager | None = None) -> dict[str, type[AttentionBackend]]:
    """Every registered backend by name; names two plugins registered are left out."""
    table = collect_backends(resolve_plugin_manager(plugin_manager))
    return {name: cls for name, (cls, _) in table.unambiguous().items()}


def get_backend(name: str, plugin_manager: pluggy.PluginManager | None = None) -> type[AttentionBackend]:
    """The backend class registered under ``name`` (two plugins' name: ``PluginError``)."""
    pm = resolve_plugin_manager(plugin_manager)
    table = collect_backends(pm)
    found = table.entries.get(name, [])
    if len(found) > 1:
        raise PluginError(conflict_message(pm, name, [owner for _, owner in found]))
    if not found:
        raise ValueError(f"Unknown attention backend {name!r}. Registered: {sorted(table.unambiguous())}; "
                         "install the plugin that provides it or check KVCORE_PLUGINS/KVCORE_BLOCK_PLUGINS")
    return found[0][0]


def list_plugins(plugin_manager: pluggy.PluginManager | None = None) -> list[PluginInfo]:
    """One record per plugin: entry points in every state, then in-process plugins."""
    pm = resolve_plugin_manager(plugin_manager)
    infos = pm.plugin_infos if isinstance(pm, KVCorePluginManager) else {}
    out = [attrs.evolve(i, hooks=[], backends=[], kernel_block_sizes={}, layouts={}) for i in infos.values()]
    out += [PluginInfo(name=n) for n, _ in pm.list_name_plugin() if n not in infos and n != CORE_PLUGIN_NAME]
    by_name = {info.name: info for info in out}
    try:
        table = collect_backends(pm)
    except PluginError as exc:
        table = BackendTable({})
        culprit = by_name.get(getattr(exc, "plugin_name", None))
        if culprit is not None:
            culprit.flag("failed", str(exc))
    for name, found in table.conflicts().items():
        owners = [owner for _, owner in found]
        for owner in owners:
            by_name[owner].flag("conflict", conflict_message(pm, name, owners))
    for info in out:
        plugin = pm.get_plugin(info.name)
        if plugin is not None:
            info.hooks = sorted(c.name for c in pm.get_hookcallers(plugin) or [])
            info.backends = sorted(n for n, found in table.entries.items() if any(o == info.name for _, o in found))
    return out
