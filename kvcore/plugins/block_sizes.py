"""vLLM's block-size functions for callers that negotiate piece by piece: each reads the
negotiation's own rules, asking the hooks through one ``HookAnswers`` per call (``KVCache.create``
asks once for the whole cache)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pluggy

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.layout import split_ratio
from kvcore.plugins.answers import HookAnswers, Refused
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.negotiation import common_block_size, group_kernel_block_size, splits_by_backends
from kvcore.specs import KVCacheSpec


def select_common_block_size(kv_manager_block_size: int, backends: Sequence[type[AttentionBackend] | str],
                             kv_cache_specs: Sequence[KVCacheSpec | None] | None = None, *,
                             plugin_manager: pluggy.PluginManager | None = None) -> int:
    """The kernel block size ``backends`` share for ``kv_manager_block_size``-token blocks.

    The manager size when every backend accepts it, else the largest offered ``int`` dividing it
    that every backend accepts.
    """
    manager = positive_int("kv_manager_block_size", kv_manager_block_size)
    if isinstance(backends, (str, type)):
        raise TypeError(f"backends must be a list of backends, got {backends!r}; wrap it: [{backends!r}]")
    answers = HookAnswers(plugin_manager)
    classes = [answers.backend(b) for b in backends]
    specs = [None] * len(classes) if kv_cache_specs is None else list(kv_cache_specs)
    if len(specs) != len(classes):
        raise ValueError(f"kv_cache_specs has {len(specs)} entries for {len(classes)} "
                         "backends; pass one spec (or None) per backend")
    size = common_block_size(answers, manager, list(zip(classes, specs)))
    if isinstance(size, Refused):
        raise ValueError(size)
    return size


def customize_attention_spec(backend: type[AttentionBackend] | str, spec: KVCacheSpec, *,
                             plugin_manager: pluggy.PluginManager | None = None) -> KVCacheSpec:
    """``spec`` as ``backend`` stores it: the plugin's changes, then block-stride alignment
    (``MultipleOf(max(sizes))`` for a backend taking only ``int`` sizes)."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    answers = HookAnswers(plugin_manager)
    return answers.customized_spec(answers.backend(backend), spec)


def prepare_kernel_block_sizes(kv_cache_config: KVCacheConfig, attn_groups: Sequence[Sequence[Any]], *,
                               plugin_manager: pluggy.PluginManager | None = None) -> list[int]:
    """The kernel block size of every KV cache group with pages, in order."""
    answers = HookAnswers(plugin_manager)
    out: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if gid >= len(attn_groups) and splits_by_backends(kv_cache_config, group):
            raise ValueError(f"attn_groups has {len(attn_groups)} entries but KV cache group "
                             f"{gid} needs one; pass build_attention_groups(kv_cache_config, ...)")
        groups = attn_groups[gid] if gid < len(attn_groups) else []
        pairs = [(g.backend, g.kv_cache_spec) for g in groups]
        size, _ = group_kernel_block_size(kv_cache_config, gid, pairs, answers)
        if isinstance(size, Refused):
            raise ValueError(size)
        if size is not None:
            out.append(size)
    return out


def get_block_table_width(max_num_blocks: int, block_size: int, kernel_block_size: int | None = None, *,
                          token_alignment: int | None = 128) -> int:
    """Columns of a block table row, as vLLM sizes them: manager blocks rounded up to cover a
    multiple of ``token_alignment`` tokens, times the split ratio (``(1875, 64) == 1876``)."""
    max_num_blocks = positive_int("max_num_blocks", max_num_blocks)
    block_size = positive_int("block_size", block_size)
    ratio = split_ratio(block_size, kernel_block_size)
    if token_alignment is not None:
        unit = math.lcm(block_size, positive_int("token_alignment", token_alignment)) // block_size
        max_num_blocks = -(-max_num_blocks // unit) * unit
    return max_num_blocks * ratio
