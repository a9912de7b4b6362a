"""The environment settings kvcore honours, read in one place into one typed object.

``Settings.from_env()`` is called where a call begins (``KVCache.create``, the
CLI, a kernel function called directly) and the result is passed down, so a
changed environment takes effect at the next call and no layer below reads
``os.environ``: ``KVCache.create`` hands its settings to the zeroer and the
attention groups, which put ``debug_checks`` on each step's metadata for the
backends' per-layer ``forward``. Parsing is strict: a value that is not one of the accepted
spellings is a ``ValueError`` naming the variable. (``KVCORE_KV_CACHE_LAYOUT``
is read by ``resolve_kv_cache_layout`` itself, SPEC §3; the plugin switches
when a plugin manager is built, SPEC §4, through :func:`env_flag` and :func:`env_names`.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """Switch ``name`` of ``environ`` (default ``os.environ``): True, False, or None when unset or empty."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(
        f"{name}={raw!r} is not a switch; accepted values: 0/1/true/false (or no/yes, off/on)"
    )


def env_names(name: str, environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """Comma-separated names in variable ``name`` (blanks dropped), or None when unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return frozenset(n.strip() for n in value.split(",") if n.strip()) if value else None


@attrs.frozen
class Settings:
    """kvcore's environment switches, parsed.

    ``debug_checks``: ``KVCORE_DEBUG_CHECKS``; True/False forces the checks
    that read tensor values on the host (a device sync on GPUs) on or off,
    None leaves them to the device (on for CPU tensors, off on GPUs).
    ``triton_interpret``: ``TRITON_INTERPRET=1``, Triton kernels run on CPU
    tensors through its interpreter (set before triton is first imported).
    """

    debug_checks: bool | None = None
    triton_interpret: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of ``environ`` (default: ``os.environ`` now); ``ValueError`` names a bad variable."""
        return cls(
            debug_checks=env_flag("KVCORE_DEBUG_CHECKS", environ),
            # NOTE: Triton's own reading of the variable, so kvcore never disagrees with it.
            triton_interpret=(os.environ if environ is None else environ)
            .get("TRITON_INTERPRET", "")
            .strip()
            .lower()
            in ("1", "true", "yes", "on", "y"),
        )
