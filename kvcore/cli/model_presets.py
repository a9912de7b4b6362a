"""``kvcore models``: the model presets that ``kvcore plan`` takes by name."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvcore._table import Column, render

# NOTE: where kvcore.model_files keeps the presets (a test checks they agree); that
# module imports torch, so it is imported only when the command runs.
_PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "models",
        help="list the model presets that kvcore plan knows",
        description=f"List the model presets (TOML files in {_PRESET_DIR}) that "
        "'kvcore plan NAME' takes by name: their layers and layer kinds. Any other "
        "model is a TOML file in the same format (see kvcore/model_files.py).",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)
    return parser


def describe(name: str) -> dict[str, Any]:
    """One preset: its name, title, layer count, layer kinds and file."""
    from kvcore.model_files import find_model, load_model_file

    model = load_model_file(name)
    kinds = Counter(type(s).__name__.removesuffix("Spec") for s in model.kv_cache_specs.values())
    return {
        "preset": name,
        "name": model.name,
        "num_layers": len(model.kv_cache_specs),
        "kinds": dict(kinds),
        "file": str(find_model(name)),
    }


def run(args: argparse.Namespace) -> int:
    from kvcore.model_files import PRESET_DIR, preset_names

    presets = [describe(name) for name in preset_names()]
    if args.json:
        print(json.dumps(presets, indent=2))
        return 0
    if not presets:
        print(f"No model presets found in {PRESET_DIR}.")
        return 0
    columns = [Column("preset"), Column("model"), Column("layers", right=True),
               Column("layer kinds", wrap=True)]
    rows = [[p["preset"], p["name"], str(p["num_layers"]),
             ", ".join(f"{n} x {kind}" for kind, n in p["kinds"].items())] for p in presets]
    print(render(columns, rows, title="kvcore plan presets ('kvcore plan PRESET --memory 40GiB')"))
    print(f"files: {PRESET_DIR}")
    return 0
