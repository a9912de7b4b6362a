"""What ``kvcore plan`` reports about a plan: capacity, padding per group, warnings.

Every number here is one a user can rely on: capacities come from
:class:`~kvcore.memory.config.KVCacheConfig` (null block excluded, whole
blocks per group), padding is measured on the planned specs, and a block size
is only suggested after the model has been grouped with it.
"""

from __future__ import annotations

from typing import Any

from kvcore._units import format_bytes
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.plan_groups import group_layers, is_encoder_only
from kvcore.model_files import ModelDescription
from kvcore.specs import KVCacheSpec

#: Padding above this share of a group's pages gets a warning.
PADDING_WARN_PERCENT = 10.0
# NOTE: block sizes tried for a remedy: multiples of 16, which attention kernels take.
_CANDIDATE_BLOCK_SIZES = range(16, 2048 + 1, 16)


def group_padding(group: KVCacheGroupSpec) -> tuple[int, int]:
    """``(padded bytes, real bytes)`` of one block of every layer of ``group``."""
    specs = [group.spec_of(name) for name in group.layer_names]
    return sum(s.page_size_bytes for s in specs), sum(s.real_page_size_bytes for s in specs)


def padding_percent(group: KVCacheGroupSpec) -> float:
    """Share of the group's pages that is padding, in percent (0 for no padding)."""
    padded, real = group_padding(group)
    return 100.0 * (padded - real) / padded if padded else 0.0


def worst_padding(kv_cache_specs: dict[str, KVCacheSpec]) -> float:
    """The largest padding percentage over the groups the planner makes of these layers."""
    return max((padding_percent(g) for g in group_layers(kv_cache_specs) if not is_encoder_only(g)),
               default=0.0)


def block_size_remedy(model: ModelDescription) -> tuple[int, float] | None:
    """The smallest block size (a multiple of 16) whose groups pad at most the warning share.

    ``(block size, worst padding percent)``, or None if none up to 2048 does.
    """
    for block_size in _CANDIDATE_BLOCK_SIZES:
        try:
            specs = {n: s.copy_with_new_block_size(block_size) for n, s in model.kv_cache_specs.items()}
            worst = worst_padding(specs)
        except ValueError:  # e.g. MLA pages that do not divide: not a remedy
            continue
        if worst <= PADDING_WARN_PERCENT:
            return block_size, worst
    return None


def _window_blocks(window: int, block_size: int) -> int:
    """Blocks that hold the last ``window`` tokens of a sequence at most."""
    return -(-(window - 1) // block_size) + 1


def _group(config: KVCacheConfig, group_id: int) -> dict[str, Any]:
    group = config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    padded, real = group_padding(group) if not is_encoder_only(group) else (0, 0)
    pages = sorted({group.spec_of(n).page_size_bytes for n in group.layer_names})
    state = config.is_state_group(group_id)
    out: dict[str, Any] = {
        "id": group_id,
        "kind": type(spec).__name__,
        "block_size": spec.block_size,
        "page_size_bytes": 0 if is_encoder_only(group) else pages[-1],
        "padding_bytes": padded - real,
        "padding_percent": round(100.0 * (padded - real) / padded, 2) if padded else 0.0,
        "num_layers": len(group.layer_names),
        "layers": list(group.layer_names),
        "keeps_cache": not is_encoder_only(group),
        "is_state": state,
        "token_capacity": None if state or is_encoder_only(group) else config.group_token_capacity(group_id),
    }
    for key in ("sliding_window", "attention_chunk_size"):
        value = getattr(spec, key, None)
        if value is not None:
            out[key] = value
    return out


def capacity(config: KVCacheConfig) -> dict[str, Any]:
    """Token and sequence capacity of the whole plan, and what limits them."""
    groups = [g for g in config.kv_cache_groups if not is_encoder_only(g)]
    growing = [i for i, g in enumerate(config.kv_cache_groups)
               if not is_encoder_only(g) and not config.is_state_group(i)]
    out: dict[str, Any] = {
        "usable_blocks": config.usable_blocks,
        "token_capacity": config.token_capacity,
        "blocks_for_one_token": config.blocks_per_sequence(1) if groups else 0,
        "state_only": bool(groups) and not growing,
    }
    # NOTE: a state-only model holds sequences of any length, one block per group each.
    out["sequence_capacity"] = config.sequence_capacity(1) if out["state_only"] else None
    return out


def warnings_for(model: ModelDescription, groups: list[dict[str, Any]]) -> list[str]:
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
            f"group {g['id']} ({_kind_name(g)}): each {format_bytes(page - pad)} page is padded "
            f"to {format_bytes(page)}, the model's largest page, so {g['padding_percent']:.1f}% "
            "of this group's memory is padding. Remedy: a block size whose page matches or "
            f"divides the largest page; {fix} (padding does not depend on the layout)."
        )
    return out


def _kind_name(group: dict[str, Any]) -> str:
    return group["kind"].removesuffix("Spec")


def _ids(ids: list[int]) -> str:
    if len(ids) == 1:
        return f"group {ids[0]}"
    consecutive = ids == list(range(ids[0], ids[-1] + 1))
    return f"groups {ids[0]}-{ids[-1]}" if consecutive else f"groups {', '.join(map(str, ids))}"


def window_notes(groups: list[dict[str, Any]]) -> list[str]:
    """What each sliding window or attention chunk means for capacity (one note per kind of group)."""
    by_window: dict[tuple[str, int, int], list[int]] = {}
    for g in groups:
        if g["kind"] == "FullAttentionSpec" or not g["keeps_cache"]:
            continue  # NOTE: a full-attention spec's window fields describe merged layers
        for key in ("sliding_window", "attention_chunk_size"):
            if key in g:
                by_window.setdefault((key, g[key], g["block_size"]), []).append(g["id"])
    notes = []
    for (key, tokens, block_size), ids in by_window.items():
        if key == "sliding_window":
            notes.append(
                f"{_ids(ids)}: sliding window of {tokens:,} tokens: attention reads only each "
                f"token's last {tokens:,} tokens, so a scheduler that frees blocks behind the "
                f"window keeps at most {_window_blocks(tokens, block_size):,} blocks per "
                "sequence in each of these groups; the token capacity above counts every "
                "block (no window discount)."
            )
        else:
            notes.append(
                f"{_ids(ids)}: attention within chunks of {tokens:,} tokens; the token "
                "capacity above counts every block of the sequence."
            )
    return notes


def summarize(model: ModelDescription, config: KVCacheConfig) -> dict[str, Any]:
    """The plan as plain data (what ``kvcore plan --json`` prints)."""
    tensors = config.kv_cache_tensors
    bytes_per_block = tensors[0].size // config.num_blocks if tensors else 0
    group_ids = {name: i for i, g in enumerate(config.kv_cache_groups) for name in g.layer_names}
    groups = [_group(config, i) for i in range(len(config.kv_cache_groups))]
    return {
        "model": model.name,
        "source": model.source,
        "layout": config.layout.name,
        "num_layers": len(model.kv_cache_specs),
        "num_blocks": config.num_blocks,
        "bytes_per_block": bytes_per_block,
        "total_bytes": tensors[0].size if tensors else 0,
        **capacity(config),
        "groups": groups,
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
        "notes": window_notes(groups),
        "warnings": warnings_for(model, groups),
    }
