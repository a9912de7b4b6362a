"""``kvcore plugins``: every plugin kvcore sees, checked, including broken ones.

Each plugin is one record (never a wide table), wrapped between words to the
terminal width (80 columns when piped), so nothing is cut. The command exits
1 when a plugin failed to load, conflicts with another or answers a hook
badly, or when no attention backend is usable (none installed, or all kept
from loading), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import warnings
from typing import TYPE_CHECKING

import attrs

from kvcore.errors import PluginWarning

if TYPE_CHECKING:
    from kvcore.plugins.manager import PluginInfo

_LABEL = 14


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plugins",
        help="list and health-check installed kvcore plugins",
        description="List every kvcore plugin (entry points in group kvcore.plugins) with its "
        "status, hooks and backends; ask every backend's hooks once about a representative "
        "full-attention spec and show the kernel block sizes and layouts it declares. Exits 1 "
        "when a plugin failed, conflicts with another or answers a hook badly.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per plugin")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # NOTE: imported when the command runs, not with its parser: the plugin
    # machinery imports torch, and `kvcore plugins --help` stays torch-free.
    from kvcore.plugins.health import auto_picks, check_plugins, is_healthy
    from kvcore.plugins.answers import HookAnswers
    from kvcore.plugins.registry import PluginSettings, build_plugin_manager

    # NOTE: listing never raises for a broken plugin, even under KVCORE_STRICT_PLUGINS:
    # failures are shown in the records instead.
    settings = PluginSettings.from_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        pm = build_plugin_manager(attrs.evolve(settings, strict=False))
    answers = HookAnswers(pm)
    infos = check_plugins(pm, answers)
    picks = auto_picks(answers)
    declared = _requirements(pm, answers)
    # NOTE: settings that match no entry point (say KVCORE_PLUGINS=typo) are in no plugin's
    # record, and must not pass as healthy.
    for problem in pm.settings_problems:
        print(f"kvcore plugins: warning: {problem}", file=sys.stderr)
    unusable = no_backend_reason(infos, autoload=settings.autoload)
    if unusable:
        print(f"kvcore plugins: error: {unusable}", file=sys.stderr)
    healthy = is_healthy(infos) and not pm.settings_problems and not unusable
    if args.json:
        print(json.dumps([_json(info, declared, picks) for info in infos], indent=2))
    else:
        print(render(infos, shutil.get_terminal_size((80, 24)).columns, healthy, declared, picks))
    return 0 if healthy else 1


def _requirements(pm: object, answers: object) -> dict[str, object]:
    """Backend name -> the KernelRequirements it declared to the health check."""
    from kvcore.errors import PluginError
    from kvcore.plugins.health import REPRESENTATIVE_SPEC
    from kvcore.plugins.manager import collect_backends

    out: dict[str, object] = {}
    try:
        table = collect_backends(pm).unambiguous()  # type: ignore[arg-type]
    except PluginError:
        return out
    for name, (backend, _) in table.items():
        try:
            out[name] = answers.requirements(backend, REPRESENTATIVE_SPEC)  # type: ignore[attr-defined]
        except PluginError:
            continue  # NOTE: check_plugins already marked the plugin unhealthy
    return out


def _json(info: PluginInfo, declared: dict[str, object], picks: dict[str, str | None]) -> dict[str, object]:
    """One plugin's JSON object: its record, each backend's requirements and where "auto" picks it."""
    from kvcore.plugins.health import requirements_json

    item = info.to_json()
    item["requirements"] = {
        b: requirements_json(declared[b]) for b in info.backends if b in declared  # type: ignore[arg-type]
    }
    item["auto"] = {b: [d for d, pick in picks.items() if pick == b] for b in info.backends}
    return item


def no_backend_reason(infos: list[PluginInfo], *, autoload: bool = True) -> str | None:
    """Why no attention backend can be used, or None when a loaded plugin registers one.

    ``autoload``: the settings' switch (False under KVCORE_DISABLE_PLUGIN_AUTOLOAD=1).
    """
    if any(info.backends for info in infos if info.status == "loaded"):
        return None
    reason = "no attention backend is usable: "
    if not autoload:
        return reason + (
            f"KVCORE_DISABLE_PLUGIN_AUTOLOAD=1 keeps the {len(infos)} installed plugin"
            f"{'s' * (len(infos) != 1)} from loading; unset it, or register a backend in-process "
            "(get_plugin_manager(autoload=False).register(...))"
        )
    if not infos:
        return reason + "no kvcore plugin is installed; install one, such as kvcore-torch"
    return reason + "no loaded plugin registers a backend; see each plugin's status and error"


def _field(label: str, value: str, width: int) -> list[str]:
    indent = " " * (2 + _LABEL)
    return textwrap.wrap(
        value or "-",
        width=max(width, _LABEL + 20),
        initial_indent=f"  {label:<{_LABEL}}",
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _sizes(sizes: list[int | dict[str, int]]) -> str:
    return ", ".join(f"multiple of {s['multiple_of']}" if isinstance(s, dict) else str(s) for s in sizes)


def render_one(info: PluginInfo, width: int, requirements: dict[str, object] | None = None) -> list[str]:
    """The lines of one plugin's record (``declared``: backend -> its KernelRequirements)."""
    lines = [f"{info.name}  [{info.status}]"]
    where = "in-process" if info.entry_point is None else f"{info.distribution or '?'} {info.version or '?'}"
    lines += _field("distribution", where, width)
    if info.entry_point is not None:
        lines += _field("entry point", info.entry_point, width)
    lines += _field("hooks", ", ".join(h.removeprefix("kvcore_") for h in info.hooks), width)
    for backend in info.backends or [""]:
        if not backend:
            lines += _field("backends", "", width)
            continue
        declared: list[str] = []
        if backend in info.kernel_block_sizes:
            declared.append(f"kernel block sizes {_sizes(info.kernel_block_sizes[backend])}")
        if backend in info.layouts:
            layouts = info.layouts[backend]
            declared.append("layouts " + ("any" if layouts is None else ", ".join(layouts)))
        lines += _field("backend", f"{backend}" + (f": {'; '.join(declared)}" if declared else ""), width)
        if requirements and backend in requirements:
            from kvcore.plugins.health import describe_requirements

            lines += _field("requires", describe_requirements(requirements[backend]), width)  # type: ignore[arg-type]
    if info.error:
        lines += _field("error", info.error, width)
    return lines


def render(
    infos: list[PluginInfo],
    width: int,
    healthy: bool,
    requirements: dict[str, object] | None = None,
    picks: dict[str, str | None] | None = None,
) -> str:
    """Every plugin's record, separated by blank lines (``healthy``: the check passed).

    ``picks`` (device type -> backend name or None) ends the listing with what
    ``"auto"`` picks for the representative spec.
    """
    if not infos:
        return "No kvcore plugins installed (entry-point group kvcore.plugins)."
    header = f"kvcore plugins: {len(infos)} found" + ("" if healthy else "; some need attention (exit 1)")
    blocks = [header, *("\n".join(render_one(i, width, requirements)) for i in infos)]
    if picks:
        text = "; ".join(f"{device}: {name or 'no backend can serve it'}" for device, name in picks.items())
        blocks.append("\n".join(_field("auto picks", text + " (bf16, 8 KV heads of 128)", width)))
    return "\n\n".join(blocks)
