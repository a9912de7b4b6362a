"""``kvcore plan``: plan a model's KV cache and show groups, tensors and capacity."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from kvcore._table import Column, render, terminal_width
from kvcore._units import SIZE_UNITS_HELP, format_bytes, format_bytes_exact
from kvcore.bench._args import layout_arg, layout_names, positive_int_arg, size_arg

# NOTE: the planner, the model loader and the summary import torch: they are
# imported in run(), so that 'kvcore plan --help' and usage errors are quick.

_DESCRIPTION = """\
Plan the KV cache of a model described in TOML (a file, or a preset: see
'kvcore models') and show its groups, tensors, bytes per block, block count
and capacity. Sizes: """ + SIZE_UNITS_HELP + "."


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="plan a model's KV cache for a memory budget", description=_DESCRIPTION
    )
    parser.add_argument("model", help="a model TOML file, or a preset name ('kvcore models' lists them)")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--memory", type=size_arg, metavar="SIZE",
        help="KV cache memory, e.g. 40GiB (= 40G, binary) or 80GB (decimal, 10^9 bytes)",
    )  # fmt: skip
    budget.add_argument("--num-blocks", type=positive_int_arg, metavar="N", help="plan exactly N blocks")
    parser.add_argument("--layout", type=layout_arg, default="LBNHC",
                        help=f"physical layout, one of {layout_names()} (default: %(default)s)")
    parser.add_argument("--block-size", type=positive_int_arg, metavar="TOKENS",
                        help="block size for every layer type (default: the model file's)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def span(layers: list[str]) -> str:
    """Layer indices as ranges (``0-4, 6-10``), or the first and last name."""
    from kvcore.model_runner.binding import extract_layer_index

    try:
        indices = [extract_layer_index(name) for name in layers]
    except ValueError:
        return layers[0] if len(layers) == 1 else f"{layers[0]} to {layers[-1]}"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _group_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for g in summary["groups"]:
        if g["is_state"]:
            tokens = "any (1 block)"
        elif g["token_capacity"] is None:
            tokens = "-"
        else:
            tokens = f"{g['token_capacity']:,}"
        rows.append([
            str(g["id"]), g["kind"].removesuffix("Spec"), str(g["num_layers"]), str(g["block_size"]),
            format_bytes(g["page_size_bytes"]) if g["keeps_cache"] else "-",
            f"{g['padding_percent']:.1f}%" if g["padding_bytes"] else "0%", tokens, span(g["layers"]),
        ])  # fmt: skip
    return rows


def _capacity_line(summary: dict[str, Any]) -> tuple[str, str]:
    groups = [g for g in summary["groups"] if g["keeps_cache"]]
    if not groups:
        return "capacity", "no layer keeps a KV cache (encoder-only model)"
    if summary["state_only"] and summary["sequence_capacity"] == 0:
        return "capacity", (
            f"no sequence fits: one sequence needs {summary['blocks_for_one_token']} blocks (one per "
            f"state group) but only {summary['usable_blocks']:,} are usable; plan at least "
            f"{summary['blocks_for_one_token'] + 1} blocks"
        )
    if summary["state_only"]:
        where = "its one group" if len(groups) == 1 else f"each of the {len(groups)} groups"
        return "capacity", (
            f"{summary['sequence_capacity']:,} sequences of any length (state caches only: each "
            f"sequence takes one block in {where})"
        )
    if summary["token_capacity"] == 0:
        return "token capacity", (
            f"0 tokens: one sequence needs {summary['blocks_for_one_token']} blocks (one per "
            f"group) but only {summary['usable_blocks']:,} are usable; plan more blocks"
        )
    states = sum(g["is_state"] for g in groups)
    state_text = f"; each of the {states} state groups takes 1 block" if states else ""
    return "token capacity", (
        f"{summary['token_capacity']:,} tokens in one sequence (every group keeping all its "
        f"blocks, rounded up to whole blocks{state_text})"
    )


def print_plan(summary: dict[str, Any], out=None) -> None:
    """The plan as tables and lines that fit the terminal (80 columns when piped)."""
    out = out or sys.stdout
    width = terminal_width()
    group_columns = [
        Column("group", right=True), Column("kind"), Column("layers", right=True),
        Column("block size", right=True), Column("page", right=True), Column("padding", right=True),
        Column("max tokens", right=True), Column("layer indices", wrap=True),
    ]  # fmt: skip
    title = f"{summary['model']}: KV cache groups ({summary['layout']})"
    print(render(group_columns, _group_rows(summary), title=title, width=width), file=out)
    if sum(g["token_capacity"] is not None for g in summary["groups"]) > 1 or (
        summary["token_capacity"] and any(g["is_state"] for g in summary["groups"])
    ):
        print(textwrap.fill("max tokens: one sequence in that group alone, with every usable block "
                            "(groups share the blocks, so together they hold the token capacity "
                            "below)", width), file=out)
    tensor_columns = [Column("group", right=True), Column("layers", right=True),
                      Column("layer stride", right=True), Column("block stride", right=True),
                      Column("size", right=True)]
    rows = [[str(t["group"]), str(t["num_layers"]), format_bytes(t["layer_stride"]),
             format_bytes(t["block_stride"]), format_bytes(t["size"])] for t in summary["tensors"]]
    print(file=out)
    print(render(tensor_columns, rows, title="tensors (one allocation; every group's tensor starts "
                 "at byte 0)", width=width), file=out)
    print(file=out)
    usable = summary["usable_blocks"]
    lines = [
        ("bytes per block", format_bytes_exact(summary["bytes_per_block"])),
        ("blocks", f"{summary['num_blocks']:,} ({usable:,} usable: block 0 is the null block)"),
        ("total", format_bytes_exact(summary["total_bytes"])),
        _capacity_line(summary),
    ]
    for label, text in lines:
        print(textwrap.fill(text, width, initial_indent=f"{label + ':':<17}", subsequent_indent=" " * 17),
              file=out)
    for note in summary["notes"]:
        print(textwrap.fill(note, width, initial_indent="note: ", subsequent_indent="  "), file=out)


def run(args: argparse.Namespace) -> int:
    from kvcore.cli.plan_summary import summarize
    from kvcore.memory.planner import plan_kv_cache
    from kvcore.model_files import load_model_file

    model = load_model_file(args.model, block_size=args.block_size)
    config = plan_kv_cache(
        model.kv_cache_specs, args.layout, available_memory=args.memory, num_blocks=args.num_blocks
    )
    summary = summarize(model, config)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_plan(summary)
    for warning in summary["warnings"]:
        print(textwrap.fill(warning, terminal_width(), initial_indent="warning: ", subsequent_indent="  "),
              file=sys.stderr)
    return 0
