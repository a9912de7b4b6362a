"""``kvcore plan``: plan a model's KV cache and show groups, tensors and capacity."""

from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction
from typing import Any

from kvcore.model_runner.binding import extract_layer_index
from kvcore.cli._args import layout_arg
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.layout import KVCacheLayout
from kvcore.models import ModelDescription, load_model, preset_names
from kvcore.memory.plan_groups import is_encoder_only
from kvcore.memory.planner import plan_kv_cache

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KIB": 1 << 10, "KB": 10**3,
    "M": 1 << 20, "MIB": 1 << 20, "MB": 10**6,
    "G": 1 << 30, "GIB": 1 << 30, "GB": 10**9,
    "T": 1 << 40, "TIB": 1 << 40, "TB": 10**12,
}  # fmt: skip
_MEMORY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_memory(text: str) -> int:
    """Bytes from ``40GiB``, ``512MB``, ``1.5G`` (binary) or a plain byte count."""
    match = _MEMORY.match(text)
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid memory size {text!r}; use bytes or a number with a unit "
            "such as 40GiB, 512MiB, 80GB"
        )
    return int(Fraction(match.group(1)) * _UNITS[unit])


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="plan a model's KV cache for a memory budget",
        description="Plan the KV cache of a model described in TOML (a path, or a preset: "
        f"{', '.join(preset_names())}) and show its groups, tensors, bytes per block, "
        "block count and token capacity.",
    )
    parser.add_argument("model", help="a model TOML file or a preset name")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", type=parse_memory, help="KV cache memory, e.g. 40GiB")
    budget.add_argument("--num-blocks", type=int, help="plan exactly this many blocks")
    parser.add_argument("--layout", type=layout_arg, default=KVCacheLayout.LBNHC,
                        help="physical layout (default LBNHC): " + ", ".join(m.name for m in KVCacheLayout))
    parser.add_argument("--block-size", type=int, help="block size (tokens) for every layer type")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def token_capacity(config: KVCacheConfig) -> int:
    """Tokens one sequence can hold when every attention group keeps all its blocks.

    Each state-cache group takes one block per sequence; sliding windows are
    not discounted, so this is a lower bound for models that have them.
    """
    per_token, fixed = Fraction(0), 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if is_encoder_only(group):
            continue
        if spec.tokens_per_state <= 0:
            fixed += 1
        else:
            per_token += Fraction(1, spec.block_size)
    if per_token == 0:
        return 0
    return max(0, int((config.num_blocks - fixed) / per_token))


def summarize(model: ModelDescription, config: KVCacheConfig) -> dict[str, Any]:
    """The plan as plain data (what ``--json`` prints)."""
    tensors = config.kv_cache_tensors
    bytes_per_block = tensors[0].size // config.num_blocks if tensors else 0
    group_ids = {name: i for i, g in enumerate(config.kv_cache_groups) for name in g.layer_names}
    return {
        "model": model.name,
        "source": model.source,
        "layout": config.layout.name,
        "num_layers": len(model.kv_cache_specs),
        "num_blocks": config.num_blocks,
        "bytes_per_block": bytes_per_block,
        "total_bytes": tensors[0].size if tensors else 0,
        "token_capacity": token_capacity(config),
        "groups": [
            {
                "id": i,
                "kind": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "page_size_bytes": 0 if is_encoder_only(g) else g.kv_cache_spec.page_size_bytes,
                "num_layers": len(g.layer_names),
                "layers": list(g.layer_names),
            }
            for i, g in enumerate(config.kv_cache_groups)
        ],
        "tensors": [
            {
                "group": group_ids[t.layers[0]],
                "num_layers": len(t.layers),
                "layers": list(t.layers),
                "size": t.size,
                "offset": t.offset,
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
            }
            for t in tensors
        ],
    }


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f} {unit})"
    return f"{n:,}"


def _span(layers: list[str]) -> str:
    """Layer indices as ranges (``0-4,6-10``), or the first and last name."""
    try:
        indices = [extract_layer_index(name) for name in layers]
    except ValueError:
        return layers[0] if len(layers) == 1 else f"{layers[0]} … {layers[-1]}"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _print(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    groups = Table(title=f"{summary['model']}: KV cache groups ({summary['layout']})")
    for column in ("group", "kind", "layers", "block size", "page bytes", "layer indices"):
        groups.add_column(column, overflow="fold")
    for g in summary["groups"]:
        groups.add_row(str(g["id"]), g["kind"].removesuffix("Spec"), str(g["num_layers"]), str(g["block_size"]),
                       f"{g['page_size_bytes']:,}", _span(g["layers"]))
    tensors = Table(title="tensors (one allocation; groups overlay from byte 0)")
    for column in ("group", "layers", "offset", "layer stride", "block stride", "size"):
        tensors.add_column(column, justify="right")
    for t in summary["tensors"]:
        tensors.add_row(str(t["group"]), str(t["num_layers"]), f"{t['offset']:,}",
                        f"{t['layer_stride']:,}", f"{t['block_stride']:,}", f"{t['size']:,}")
    console.print(groups)
    console.print(tensors)
    console.print(f"bytes per block: {_bytes(summary['bytes_per_block'])}")
    console.print(f"blocks:          {summary['num_blocks']:,}")
    console.print(f"total:           {_bytes(summary['total_bytes'])}")
    console.print(f"token capacity:  {summary['token_capacity']:,} (one sequence, no window discount)")


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model, block_size=args.block_size)
    config = plan_kv_cache(
        model.kv_cache_specs, args.layout, available_memory=args.memory, num_blocks=args.num_blocks
    )
    summary = summarize(model, config)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print(summary)
    return 0
