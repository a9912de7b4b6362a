"""Block-size negotiation for standalone callers (SPEC §3).

The scheduler hands out manager blocks; a kernel may only take smaller
blocks, so each manager block is split into kernel blocks of a size every
backend of a group accepts. What a backend accepts comes from the
``kvcore_supported_kernel_block_sizes`` hook, never from the backend class.
Each function here negotiates through :mod:`kvcore.plugins.negotiation`
(one ``HookAnswers`` per call), then reads the answer; ``KVCache.create``
negotiates once for its whole plan and keeps the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheConfig
from kvcore.plugins.answers import HookAnswers, label
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.negotiation import group_kernel_block_size, splits_by_backends
from kvcore.plugins.selection import get_block_table_width, pick_common_block_size
from kvcore.specs import KVCacheSpec, MultipleOf

__all__ = [
    "customize_attention_spec",
    "get_block_table_width",
    "prepare_kernel_block_sizes",
    "select_common_block_size",
    "supported_kernel_block_sizes",
]


def supported_kernel_block_sizes(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[int | MultipleOf]:
    """The kernel block sizes ``backend`` accepts for ``spec``, as its plugin declares."""
    answers = HookAnswers(plugin_manager)
    return answers.kernel_block_sizes(answers.backend(backend), spec)


def select_common_block_size(
    kv_manager_block_size: int,
    backends: Sequence[type[AttentionBackend] | str],
    kv_cache_specs: Sequence[KVCacheSpec | None] | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> int:
    """The kernel block size shared by ``backends`` for ``kv_manager_block_size``-token blocks.

    The manager size itself when every backend accepts it; else the largest
    explicit ``int`` size offered by any backend that divides the manager size
    and that every backend accepts (``MultipleOf`` answers never add
    candidates). No backends: the manager size.
    """
    manager = positive_int("kv_manager_block_size", kv_manager_block_size)
    if isinstance(backends, (str, type)):
        raise TypeError(f"backends must be a list of backends, got {backends!r}; wrap it: [{backends!r}]")
    answers = HookAnswers(plugin_manager)
    classes = [answers.backend(b) for b in backends]
    specs = [None] * len(classes) if kv_cache_specs is None else list(kv_cache_specs)
    if len(specs) != len(classes):
        raise ValueError(
            f"kv_cache_specs has {len(specs)} entries for {len(classes)} backends; "
            "pass one spec (or None) per backend"
        )
    offers = [(label(b), answers.kernel_block_sizes(b, s)) for b, s in zip(classes, specs)]
    return pick_common_block_size(manager, offers)


def customize_attention_spec(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> KVCacheSpec:
    """``spec`` as ``backend`` stores it: the plugin's changes, then block-stride alignment.

    When every size the backend takes is a fixed ``int`` (so manager blocks may
    be split into kernel blocks) and the spec asks no alignment yet, it gets
    ``block_stride_alignment=MultipleOf(max(sizes))``: packed blocks must then
    keep whole kernel blocks.
    """
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    answers = HookAnswers(plugin_manager)
    return answers.customized_spec(answers.backend(backend), spec)


def prepare_kernel_block_sizes(
    kv_cache_config: KVCacheConfig,
    attn_groups: Sequence[Sequence[Any]],
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[int]:
    """The kernel block size of every KV cache group, in order.

    Encoder-only groups are skipped (they hold no pages). State caches, specs
    without layer views and specs with one state per block keep their block
    size. Attention groups take :func:`select_common_block_size` over their
    backends, except groups with a block-outermost packed tensor (block
    stride above layer stride): those keep the manager size and their
    backends map their own kernel tables.
    """
    answers = HookAnswers(plugin_manager)
    out: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if gid < len(attn_groups):
            pairs = [(g.backend, g.kv_cache_spec) for g in attn_groups[gid]]
        elif splits_by_backends(kv_cache_config, group):
            raise ValueError(
                f"attn_groups has {len(attn_groups)} entries but KV cache group {gid} needs "
                "one; pass build_attention_groups(kv_cache_config, ...)"
            )
        else:
            pairs = []
        size = group_kernel_block_size(kv_cache_config, gid, pairs, answers)
        if size is not None:
            out.append(size)
    return out
