"""``kvcore plan`` and ``kvcore models``: a model's KV cache plan, and the presets plan takes.

Capacities come from ``KVCacheConfig`` (null block excluded, whole blocks per group), padding is
measured on the planned specs, and a block size is suggested only after grouping with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import Counter
from typing import Any

import attrs

from kvcore._table import Column, format_ranges, render, terminal_width
from kvcore._units import format_bytes, format_bytes_exact
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.planner import group_layers, is_encoder_only, plan_kv_cache
from kvcore.model_files import PRESET_DIR, ModelDescription, load_model_file, preset_names
from kvcore.model_runner.binding import extract_layer_index
from kvcore.specs.quant import kv_cache_dtype_of

#: Padding above this share of a group's pages gets a warning.
PADDING_WARN_PERCENT = 10.0


def _padding(group: KVCacheGroupSpec) -> tuple[int, int]:
    """``(padded bytes, real bytes)`` of one block of every layer of ``group``."""
    specs = [group.spec_of(name) for name in group.layer_names]
    return sum(s.page_size_bytes for s in specs), sum(s.real_page_size_bytes for s in specs)


def _percent(padded: int, real: int) -> float:
    return 100.0 * (padded - real) / padded if padded else 0.0


def block_size_remedy(model: ModelDescription) -> tuple[int, float] | None:
    """The smallest multiple of 16 (up to 2048) whose groups pad at most the warning share, and
    their worst padding; None if none does."""
    for block_size in range(16, 2048 + 1, 16):
        try:
            specs = {n: s.copy_with_new_block_size(block_size)
                     for n, s in model.kv_cache_specs.items()}
            groups = [g for g in group_layers(specs) if not is_encoder_only(g)]
            worst = max((_percent(*_padding(g)) for g in groups), default=0.0)
        except ValueError:  # e.g. MLA pages that do not divide: not a remedy
            continue
        if worst <= PADDING_WARN_PERCENT:
            return block_size, worst
    return None


def _group(config: KVCacheConfig, group_id: int) -> dict[str, Any]:
    group = config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    keeps = not is_encoder_only(group)
    padded, real = _padding(group) if keeps else (0, 0)
    state = config.is_state_group(group_id)
    pages = [group.spec_of(n).page_size_bytes for n in group.layer_names]
    out: dict[str, Any] = {
        "id": group_id,
        "kind": type(spec).__name__,
        "block_size": spec.block_size,
        "page_size_bytes": max(pages) if keeps else 0,
        "padding_bytes": padded - real,
        "padding_percent": round(_percent(padded, real), 2),
        "num_layers": len(group.layer_names),
        "layers": list(group.layer_names),
        "keeps_cache": keeps,
        "is_state": state,
        "in_state_region": config.in_state_region(group_id),
        "token_capacity": config.group_token_capacity(group_id) if keeps and not state else None,
    }
    for key in ("sliding_window", "attention_chunk_size"):
        if getattr(spec, key, None) is not None:
            out[key] = getattr(spec, key)
    return out


def _warnings(model: ModelDescription, groups: list[dict[str, Any]]) -> list[str]:
    """A warning for every group whose pages are more than 10% padding, with the remedy."""
    padded = [g for g in groups if g["padding_percent"] > PADDING_WARN_PERCENT]
    if not padded:
        return []
    remedy = block_size_remedy(model)
    fix = (
        f"--block-size {remedy[0]} pads at most {remedy[1]:.1f}%" if remedy
        else "none up to 2048 pads 10% or less, so change the layer shapes"
    )
    out = []
    for g in padded:
        page, pad = g["page_size_bytes"], g["padding_bytes"] // g["num_layers"]
        out.append(
            f"group {g['id']} ({g['kind'].removesuffix('Spec')}): each {format_bytes(page - pad)} "
            f"page is padded to {format_bytes(page)}, the model's largest page, so "
            f"{g['padding_percent']:.1f}% of this group's memory is padding. Remedy: a block "
            f"size whose page matches or divides the largest page; {fix} (padding does not "
            "depend on the layout)."
        )
    return out


def _window_notes(groups: list[dict[str, Any]]) -> list[str]:
    """What each sliding window or attention chunk means for capacity (one note per kind)."""
    by_window: dict[tuple[str, int, int], list[int]] = {}
    for g in groups:
        # NOTE: a full-attention spec's window fields describe merged layers
        if g["kind"] != "FullAttentionSpec" and g["keeps_cache"]:
            for key in ("sliding_window", "attention_chunk_size"):
                if key in g:
                    by_window.setdefault((key, g[key], g["block_size"]), []).append(g["id"])
    notes = []
    for (key, tokens, block_size), ids in by_window.items():
        where = f"group{'s' * (len(ids) > 1)} {format_ranges(ids)}"
        if key == "sliding_window":
            blocks = -(-(tokens - 1) // block_size) + 1  # blocks holding the last `tokens` at most
            notes.append(
                f"{where}: sliding window of {tokens:,} tokens: attention reads only each "
                f"token's last {tokens:,} tokens, so a scheduler that frees blocks behind the "
                f"window keeps at most {blocks:,} blocks per sequence in each of these groups; "
                "the token capacity above counts every block (no window discount)."
            )
        else:
            notes.append(
                f"{where}: attention within chunks of {tokens:,} tokens; the token "
                "capacity above counts every block of the sequence."
            )
    return notes


def summarize(model: ModelDescription, config: KVCacheConfig) -> dict[str, Any]:
    """The plan as plain data (what ``kvcore plan --json`` prints)."""
    tensors = config.kv_cache_tensors
    groups = [_group(config, i) for i in range(len(config.kv_cache_groups))]
    kept = [g for g in groups if g["keeps_cache"]]
    # NOTE: a state-only model holds sequences of any length, one block per group each.
    state_only = bool(kept) and all(g["is_state"] for g in kept)
    region = min((t.offset for t in tensors if not config.in_state_region(config.group_of(t.layers[0])[0])), default=0)
    return {
        "model": model.name,
        "source": model.source,
        "layout": config.layout.name,
        "kv_cache_dtype": kv_cache_dtype_of(model.kv_cache_specs.values()),
        "bytes_per_token": sum(s.page_size_bytes / s.block_size for s in model.kv_cache_specs.values()
                               if s.is_attention and s.has_cache_pages),  # NOTE: state caches: per sequence
        "num_layers": len(model.kv_cache_specs),
        "num_blocks": config.num_blocks,
        "bytes_per_block": (tensors[0].size - region) // config.num_blocks if tensors else 0,
        "num_state_blocks": config.num_state_blocks,
        "state_region_bytes": region,
        "total_bytes": tensors[0].size if tensors else 0,
        "usable_blocks": config.usable_blocks,
        "token_capacity": config.token_capacity,
        "blocks_for_one_token": config.blocks_per_sequence(1) if kept else 0,
        "state_only": state_only,
        "sequence_capacity": config.sequence_capacity(1) if state_only else None,
        "groups": groups,
        "tensors": [
            {"group": config.group_of(t.layers[0])[0], "num_layers": len(t.layers), **attrs.asdict(t)}
            for t in tensors
        ],
        "notes": _window_notes(groups),
        "warnings": _warnings(model, groups),
    }


def span(layers: list[str]) -> str:
    """Layer indices as ranges (``0-4, 6-10``), or the first and last name."""
    try:
        return format_ranges([extract_layer_index(name) for name in layers])
    except ValueError:
        return layers[0] if len(layers) == 1 else f"{layers[0]} to {layers[-1]}"


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
            str(g["id"]), g["kind"].removesuffix("Spec"), str(g["num_layers"]),
            str(g["block_size"]), format_bytes(g["page_size_bytes"]) if g["keeps_cache"] else "-",
            f"{g['padding_percent']:.1f}%" if g["padding_bytes"] else "0%", tokens,
            span(g["layers"]),
        ])
    return rows


def _capacity_line(summary: dict[str, Any]) -> tuple[str, str]:
    groups = [g for g in summary["groups"] if g["keeps_cache"]]
    need, usable = summary["blocks_for_one_token"], summary["usable_blocks"]
    if not groups:
        return "capacity", "no layer keeps a KV cache (encoder-only model)"
    if summary["state_only"] and summary["sequence_capacity"] == 0:
        return "capacity", (
            f"no sequence fits: one sequence needs {need} blocks (one per state group) but only "
            f"{usable:,} are usable; plan at least {need + 1} blocks"
        )
    if summary["state_only"]:
        where = "its one group" if len(groups) == 1 else f"each of the {len(groups)} groups"
        return "capacity", (
            f"{summary['sequence_capacity']:,} sequences of any length (state caches only: each "
            f"sequence takes one block in {where})"
        )
    if summary["token_capacity"] == 0:
        return "token capacity", (
            f"0 tokens: one sequence needs {need} blocks (one per group) but only {usable:,} "
            "are usable; plan more blocks"
        )
    states = sum(g["is_state"] for g in groups)
    state_text = f"; each of the {states} state groups takes 1 block" if states else ""
    state_text = "; its states take a slot of the state region" if summary["num_state_blocks"] else state_text
    return "token capacity", (
        f"{summary['token_capacity']:,} tokens in one sequence (every group keeping all its "
        f"blocks, rounded up to whole blocks{state_text})"
    )


def print_plan(summary: dict[str, Any]) -> None:
    """The plan as tables and lines that fit the terminal (80 columns when piped)."""
    width = terminal_width()
    right = [Column(h, right=True) for h in ("layers", "block size", "page", "padding",
                                             "max tokens")]
    group_columns = [Column("group", right=True), Column("kind"), *right,
                     Column("layer indices", wrap=True)]
    title = f"{summary['model']}: KV cache groups ({summary['layout']})"
    print(render(group_columns, _group_rows(summary), title=title, width=width))
    groups = summary["groups"]
    if sum(g["token_capacity"] is not None for g in groups) > 1 or (
        summary["token_capacity"] and any(g["is_state"] for g in groups)
    ):
        print(textwrap.fill("max tokens: one sequence in that group alone, with every usable "
                            "block (groups share the blocks, so together they hold the token "
                            "capacity below)", width))
    tensor_columns = [Column(h, right=True) for h in ("group", "layers", "layer stride",
                                                      "block stride", "size")]
    rows = [[str(t["group"]), str(t["num_layers"]), format_bytes(t["layer_stride"]),
             format_bytes(t["block_stride"]), format_bytes(t["size"])] for t in summary["tensors"]]
    title = "tensors (one allocation; every group's tensor starts at byte 0)"
    region, state_blocks = summary["state_region_bytes"], summary["num_state_blocks"]
    if state_blocks:
        tensor_columns.append(Column("offset", right=True))
        rows = [[*row, format_bytes(t["offset"])] for row, t in zip(rows, summary["tensors"])]
        title = f"tensors (one allocation: the state region's groups from byte 0, the others from byte {region:,})"
    print(f"\n{render(tensor_columns, rows, title=title, width=width)}\n")
    usable = summary["usable_blocks"]
    lines = [
        ("KV cache dtype", summary["kv_cache_dtype"]),
        ("bytes per token", f"{format_bytes_exact(round(summary['bytes_per_token']))}"),
        ("bytes per block", format_bytes_exact(summary["bytes_per_block"])),
        ("blocks", f"{summary['num_blocks']:,} ({usable:,} usable: block 0 is the null block)"),
        ("total", format_bytes_exact(summary["total_bytes"])),
        _capacity_line(summary),
    ]
    if state_blocks:
        lines.insert(2, ("state region", f"{format_bytes_exact(region)}: {state_blocks:,} blocks of its own "
                         f"({state_blocks - 1:,} usable), a slot per sequence in each state group"))
    for label, text in lines:
        print(textwrap.fill(text, width, initial_indent=f"{label + ':':<17}",
                            subsequent_indent=" " * 17))
    for note in summary["notes"]:
        print(textwrap.fill(note, width, initial_indent="note: ", subsequent_indent="  "))


def run(args: argparse.Namespace) -> int:
    model = load_model_file(args.model, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    config = plan_kv_cache(model.kv_cache_specs, args.layout, available_memory=args.memory,
                           num_blocks=args.num_blocks, **model.plan_options)
    summary = summarize(model, config)
    if getattr(args, "explain", False):
        summary["explain"] = _explain(model, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_plan(summary)
        if "explain" in summary:
            print(f"\n{summary['explain']}")
    for warning in summary["warnings"]:
        print(textwrap.fill(warning, terminal_width(), initial_indent="warning: ",
                            subsequent_indent="  "), file=sys.stderr)
    return 0


def _explain(model: ModelDescription, args: argparse.Namespace) -> str:
    """The negotiation of ``model`` with the installed backends, "auto" per attention layer."""
    from kvcore.plugins.negotiate import negotiate

    specs = model.kv_cache_specs
    backends = {name: "auto" for name, spec in specs.items() if spec.is_attention}
    negotiation = negotiate(specs, backends, device=args.device, layout=args.layout,
                            available_memory=args.memory, num_blocks=args.num_blocks, max_num_seqs=1,
                            max_model_len=max(s.block_size for s in specs.values()))
    return negotiation.explain()


def run_models(args: argparse.Namespace) -> int:
    """``kvcore models``: every preset's name, title, layer count, layer kinds and file."""
    presets = []
    for name in preset_names():
        model = load_model_file(name)
        kinds = Counter(type(s).__name__.removesuffix("Spec")
                        for s in model.kv_cache_specs.values())
        presets.append({"preset": name, "name": model.name,
                        "num_layers": len(model.kv_cache_specs), "kinds": dict(kinds),
                        "file": model.source})
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
