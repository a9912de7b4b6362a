"""``kvcore plugins``: every plugin kvcore sees, including broken ones."""

from __future__ import annotations

import argparse
import json
import warnings

import attrs

from kvcore.errors import PluginWarning
from kvcore.plugins.registry import PluginSettings, build_plugin_manager, list_plugins

_STATUS_STYLE = {"loaded": "green", "failed": "bold red", "blocked": "yellow", "disabled": "dim"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plugins",
        help="list installed kvcore plugins, their hooks and backends",
        description="List every kvcore plugin (entry points in group kvcore.plugins), "
        "with its status and, for broken plugins, the error.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    # NOTE: listing never raises for a broken plugin, even under KVCORE_STRICT_PLUGINS:
    # failures are shown in the table instead.
    settings = PluginSettings.from_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        pm = build_plugin_manager(attrs.evolve(settings, strict=False))
    infos = list_plugins(pm)
    if args.json:
        print(json.dumps([info.to_json() for info in infos], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not infos:
        console.print("No kvcore plugins installed (entry-point group kvcore.plugins).")
        return 0
    table = Table(title="kvcore plugins")
    for column in ("Name", "Distribution", "Version", "Status", "Hooks", "Backends", "Error"):
        table.add_column(column, overflow="fold")
    for info in infos:
        # NOTE: Text cells, so brackets in error messages are not read as rich markup.
        table.add_row(
            Text(info.name),
            Text(info.distribution or "(in-process)"),
            Text(info.version or ""),
            Text(info.status, style=_STATUS_STYLE[info.status]),
            Text("\n".join(h.removeprefix("kvcore_") for h in info.hooks)),
            Text(", ".join(info.backends)),
            Text(info.error or "", style="red"),
        )
    console.print(table)
    return 0
