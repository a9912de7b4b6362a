"""``kvcore plugins``: every plugin kvcore sees, checked, broken ones included, one record each
(wrapped between words, never cut); exit 1 when any is unhealthy or no backend is usable."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import textwrap
import warnings
from importlib import metadata

import attrs

from kvcore._table import terminal_width
from kvcore.errors import PluginError, PluginWarning
from kvcore.plugins import health
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.manager import PluginInfo, collect_backends
from kvcore.plugins.registry import build_plugin_manager
from kvcore.plugins.requirements import describe_requirements, requirements_json
from kvcore.settings import Settings

_LABEL = 14


def run(args: argparse.Namespace) -> int:
    # NOTE: listing never raises for a broken plugin, even under KVCORE_STRICT_PLUGINS:
    # failures are shown in the records instead.
    settings = Settings.from_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        pm = build_plugin_manager(attrs.evolve(settings, strict_plugins=False))
    answers = HookAnswers(pm)
    infos = health.check_plugins(pm, answers)
    picks = health.auto_picks(answers)
    declared = _requirements(pm, answers)
    # NOTE: settings that match no entry point (say KVCORE_PLUGINS=typo) are in no plugin's
    # record, and must not pass as healthy.
    for problem in pm.settings_problems:
        print(f"kvcore plugins: warning: {problem}", file=sys.stderr)
    unusable = no_backend_reason(infos, autoload=settings.autoload)
    if unusable:
        print(f"kvcore plugins: error: {unusable}", file=sys.stderr)
    healthy = health.is_healthy(infos) and not pm.settings_problems and not unusable
    if args.json:
        print(json.dumps([_json(info, declared, picks) for info in infos], indent=2))
    else:
        print(render(infos, terminal_width(), healthy, declared, picks))
    return 0 if healthy else 1


def _requirements(pm, answers: HookAnswers) -> dict[str, object]:
    """Backend name -> the KernelRequirements it declared to the health check."""
    out: dict[str, object] = {}
    # NOTE: a PluginError here is already in the records (check_plugins marked the plugin).
    with contextlib.suppress(PluginError):
        for name, (backend, _) in collect_backends(pm).unambiguous().items():
            with contextlib.suppress(PluginError):
                out[name] = answers.requirements(backend, health.REPRESENTATIVE)
    return out


def missing_kernels(distribution: str | None) -> list[str]:
    """The distributions of a plugin's ``kernels`` extra (its kernel library) not installed here."""
    try:
        requires = (metadata.requires(distribution) or []) if distribution else []
    except metadata.PackageNotFoundError:
        return []
    kernels = [re.match(r"[\w.-]+", r)[0] for r in requires if re.search(r"""extra\s*==\s*["']kernels["']""", r)]
    return [name for name in kernels if next(iter(metadata.distributions(name=name)), None) is None]


def _json(info: PluginInfo, declared: dict, picks: dict[str, str | None]) -> dict[str, object]:
    item = info.to_json()
    item["kernels_missing"] = missing_kernels(info.distribution)
    item["requirements"] = {b: requirements_json(declared[b]) for b in info.backends
                            if b in declared}
    # NOTE: "auto" here picks for an attention spec; mixer backends (no kernel block sizes) are left out
    item["auto"] = {b: [d for d, pick in picks.items() if pick == b] for b in info.backends
                    if b in info.kernel_block_sizes or b in picks.values()}
    return item


def no_backend_reason(infos: list[PluginInfo], *, autoload: bool = True) -> str | None:
    """Why no attention backend can be used, or None when a loaded plugin registers one."""
    if any(info.backends for info in infos if info.status == "loaded"):
        return None
    reason = "no attention backend is usable: "
    if not autoload:
        return reason + (
            f"KVCORE_DISABLE_PLUGIN_AUTOLOAD=1 keeps the {len(infos)} installed plugin"
            f"{'s' * (len(infos) != 1)} from loading; unset it, or register a backend "
            "in-process (get_plugin_manager(autoload=False).register(...))"
        )
    if not infos:
        return reason + "no kvcore plugin is installed; install one, such as kvcore-torch"
    return reason + "no loaded plugin registers a backend; see each plugin's status and error"


def _field(label: str, value: str, width: int) -> list[str]:
    return textwrap.wrap(value or "-", width=max(width, _LABEL + 20),
                         initial_indent=f"  {label:<{_LABEL}}",
                         subsequent_indent=" " * (2 + _LABEL),
                         break_long_words=False, break_on_hyphens=False)


def _record(info: PluginInfo, width: int, requirements: dict) -> list[str]:
    lines = [f"{info.name}  [{info.status}]"]
    local = info.entry_point is None
    where = "in-process" if local else f"{info.distribution or '?'} {info.version or '?'}"
    lines += _field("distribution", where, width)
    if not local:
        lines += _field("entry point", info.entry_point, width)
    lines += _field("hooks", ", ".join(h.removeprefix("kvcore_") for h in info.hooks), width)
    if not info.backends:
        lines += _field("backends", "", width)
    for backend in info.backends:
        declared: list[str] = []
        if backend in info.kernel_block_sizes:
            sizes = [f"multiple of {s['multiple_of']}" if isinstance(s, dict) else str(s)
                     for s in info.kernel_block_sizes[backend]]
            declared.append(f"kernel block sizes {', '.join(sizes)}")
        if backend in info.layouts:
            layouts = info.layouts[backend]
            declared.append("layouts " + ("any" if layouts is None else ", ".join(layouts)))
        text = f"{backend}: {'; '.join(declared)}" if declared else backend
        lines += _field("backend", text, width)
        if backend in requirements:
            lines += _field("requires", describe_requirements(requirements[backend]), width)
    missing = missing_kernels(info.distribution)
    if missing:
        lines += _field("note", f"kernels: {', '.join(missing)} not installed (pip install "
                        f"'{info.distribution}[kernels]'); its forward refuses until then", width)
    if info.error:
        lines += _field("error", info.error, width)
    return lines


def render(infos: list[PluginInfo], width: int, healthy: bool, requirements: dict,
           picks: dict[str, str | None]) -> str:
    """Every plugin's record, then what ``"auto"`` picks (``picks``: device type -> name)."""
    if not infos:
        return "No kvcore plugins installed (entry-point group kvcore.plugins)."
    attention = "" if healthy else "; some need attention (exit 1)"
    blocks = [f"kvcore plugins: {len(infos)} found{attention}",
              *("\n".join(_record(i, width, requirements)) for i in infos)]
    if picks:
        text = "; ".join(f"{device}: {name or 'no backend can serve it'}"
                         for device, name in picks.items())
        blocks.append("\n".join(_field("auto picks", text + " (bf16, 8 KV heads of 128)", width)))
    return "\n\n".join(blocks)
