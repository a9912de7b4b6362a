"""What growing an elastic cache costs in each layout, computed from the plan (no memory, no GPU).

For a model planned for ``max_blocks`` blocks, blocks are added one at a time
and the granules each new block touches are counted against those already
committed. Per layout: the bytes of one block, the contiguous pieces it is
made of, how many granules one block touches, how often a grow has to map
new granules and how many at once (one per run it reaches), and the most
memory committed beyond the blocks' own bytes (partly filled granules).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvcore.memory.elastic import merge_ranges
from kvcore.memory.layout import KVCacheLayout, block_runs
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.specs import KVCacheSpec


def _block_pattern(specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout, max_blocks: int):
    """Block 0's byte runs over all layers, the run length of each and the block stride of each."""
    config = plan_kv_cache(specs, layout, num_blocks=max_blocks)
    size = config.kv_cache_tensors[0].size
    views = allocate_kv_cache(config, "meta", buffer=torch.empty(size, dtype=torch.int8, device="meta"))
    pattern = []
    for view in views.values():
        item = view.element_size()
        strides = [s * item for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, item)
        base = view.storage_offset() * item
        pattern.extend((base + o, run, strides[0]) for o in offsets)
    return pattern


def layout_cost(specs: Mapping[str, KVCacheSpec], layout: KVCacheLayout, max_blocks: int, granularity: int) -> dict:
    """Growth figures of one layout (see the module docstring); keys are stable for the JSON output."""
    pattern = _block_pattern(specs, layout, max_blocks)
    committed: set[int] = set()
    touched, events, mapped, slack = 0, 0, 0, 0
    block_bytes = sum(run for _, run, _ in pattern)
    pieces = len(merge_ranges((s, s + run) for s, run, _ in pattern))
    for b in range(max_blocks):
        granules: set[int] = set()
        for start, run, stride in pattern:
            first = start + b * stride
            granules.update(range(first // granularity, (first + run - 1) // granularity + 1))
        touched += len(granules)
        new = granules - committed
        if new and b > 0:
            events += 1
            mapped += len(new)
        committed |= granules
        slack = max(slack, len(committed) * granularity - (b + 1) * block_bytes)
    return {
        "layout": layout.name, "block_bytes": block_bytes, "pieces_per_block": pieces,
        "granules_per_block": touched / max_blocks, "grow_events": events,
        "blocks_per_grow_event": max_blocks / (events + 1),
        "mappings_per_grow_event": mapped / events if events else 0.0, "max_slack_bytes": slack,
    }


def layout_costs(specs: Mapping[str, KVCacheSpec], max_blocks: int, granularity: int) -> list[dict]:
    """:func:`layout_cost` for every layout the model can be planned in."""
    out = []
    for layout in KVCacheLayout:
        try:
            out.append(layout_cost(specs, layout, max_blocks, granularity))
        except ValueError:  # NOTE: a hybrid model's mixed pages fit block-compact layouts only
            continue
    return out
