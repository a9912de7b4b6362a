"""The environment switches kvcore honours, parsed strictly into one ``Settings`` where a call
begins (``KVCache.create``, the CLI, building a plugin manager, a kernel function called
directly) and passed down."""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """Switch ``name`` of ``environ`` (default ``os.environ``); None when unset or empty."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value and value not in _TRUE + _FALSE:
        raise ValueError(f"{name}={raw!r} is not a switch; accepted values: 0/1/true/false (or no/yes, off/on)")
    return value in _TRUE if value else None


def env_names(name: str, environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """Comma-separated names in variable ``name`` (blanks dropped); None when unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return frozenset(n.strip() for n in value.split(",") if n.strip()) if value else None


@attrs.frozen
class Settings:
    """Every environment switch kvcore reads, parsed once where a call begins.

    ``debug_checks`` (``KVCORE_DEBUG_CHECKS``): force the checks that read tensor values on
    the host (a device sync on GPUs) on or off; None: on for CPU tensors only.
    ``triton_interpret`` (``TRITON_INTERPRET``): Triton kernels run on CPU through its interpreter.
    ``kv_cache_layout`` (``KVCORE_KV_CACHE_LAYOUT``): the layout requested when a call names none
    (parsed where the layout is chosen, so the error can name the variable).
    Plugin loading: ``autoload`` (not ``KVCORE_DISABLE_PLUGIN_AUTOLOAD``), ``plugins`` (the
    entry points ``KVCORE_PLUGINS`` allows; None: all), ``blocked_plugins``
    (``KVCORE_BLOCK_PLUGINS``), ``strict_plugins`` (``KVCORE_STRICT_PLUGINS``) and
    ``trace_plugins`` (``KVCORE_TRACE_PLUGINS``).
    """

    debug_checks: bool | None = None
    triton_interpret: bool = False
    kv_cache_layout: str | None = None
    autoload: bool = True
    plugins: frozenset[str] | None = None
    blocked_plugins: frozenset[str] = frozenset()
    strict_plugins: bool = False
    trace_plugins: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of ``environ`` (default: ``os.environ`` now)."""
        environ = os.environ if environ is None else environ
        # NOTE: TRITON_INTERPRET is parsed as Triton itself parses it, so kvcore never disagrees.
        interpret = environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE + ("y",)
        return cls(env_flag("KVCORE_DEBUG_CHECKS", environ), interpret,
                   environ.get("KVCORE_KV_CACHE_LAYOUT", "").strip() or None,
                   autoload=not env_flag("KVCORE_DISABLE_PLUGIN_AUTOLOAD", environ),
                   plugins=env_names("KVCORE_PLUGINS", environ),
                   blocked_plugins=env_names("KVCORE_BLOCK_PLUGINS", environ) or frozenset(),
                   strict_plugins=bool(env_flag("KVCORE_STRICT_PLUGINS", environ)),
                   trace_plugins=bool(env_flag("KVCORE_TRACE_PLUGINS", environ)))
