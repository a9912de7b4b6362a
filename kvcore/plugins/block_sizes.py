"""Block-size negotiation between the scheduler and attention kernels.

The scheduler hands out manager blocks; a kernel may only take smaller
blocks, so each manager block is split into kernel blocks of a size every
backend of a group accepts. What a backend accepts comes from the
``kvcore_supported_kernel_block_sizes`` hook, never from the backend class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pluggy

from kvcore._validate import positive_int
from kvcore.plugins.backend import AttentionBackend
from kvcore.memory.config import KVCacheConfig
from kvcore.plugins.manager import call_first
from kvcore.plugins.registry import resolve_backend, resolve_plugin_manager
from kvcore.specs import (
    AttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheSpec,
    MultipleOf,
    UniformTypeKVCacheSpecs,
)

def _check_sizes(value: Any) -> list[int | MultipleOf]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of int or MultipleOf, got {value!r}")
    for size in value:
        if isinstance(size, MultipleOf):
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise TypeError(f"expected positive ints or MultipleOf in the list, got {size!r} in {value!r}")
    return list(value)


def supported_kernel_block_sizes(
    backend: type[AttentionBackend] | str,
    spec: KVCacheSpec | None = None,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[int | MultipleOf]:
    """The kernel block sizes ``backend`` accepts for ``spec``, as its plugin declares."""
    pm = resolve_plugin_manager(plugin_manager)
    backend = resolve_backend(backend, pm)
    sizes = call_first(
        pm, "kvcore_supported_kernel_block_sizes", _check_sizes, backend=backend, spec=spec
    )
    return [MultipleOf(1)] if sizes is None else sizes


def _accepts(sizes: Sequence[int | MultipleOf], block_size: int) -> bool:
    return any(
        s.accepts(block_size) if isinstance(s, MultipleOf) else s == block_size for s in sizes
    )


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
    pm = resolve_plugin_manager(plugin_manager)
    if isinstance(backends, (str, type)):
        raise TypeError(f"backends must be a list of backends, got {backends!r}; wrap it: [{backends!r}]")
    backends = [resolve_backend(b, pm) for b in backends]
    specs = [None] * len(backends) if kv_cache_specs is None else list(kv_cache_specs)
    if len(specs) != len(backends):
        raise ValueError(
            f"kv_cache_specs has {len(specs)} entries for {len(backends)} backends; "
            "pass one spec (or None) per backend"
        )
    sizes = [supported_kernel_block_sizes(b, s, plugin_manager=pm) for b, s in zip(backends, specs)]
    if all(_accepts(s, manager) for s in sizes):
        return manager
    candidates = {s for ss in sizes for s in ss if not isinstance(s, MultipleOf) and manager % s == 0}
    for size in sorted(candidates, reverse=True):
        if all(_accepts(s, size) for s in sizes):
            return size
    offered = "; ".join(f"{b.get_name()}: {s}" for b, s in zip(backends, sizes))
    raise ValueError(
        f"No common block size for {manager} ({offered}). Use a manager block size "
        "that every backend accepts or divides into a size they all accept."
    )


def _check_spec(value: Any) -> KVCacheSpec:
    if not isinstance(value, KVCacheSpec):
        raise TypeError(f"expected a KVCacheSpec, got {value!r}")
    return value


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
    pm = resolve_plugin_manager(plugin_manager)
    backend = resolve_backend(backend, pm)
    new = call_first(pm, "kvcore_customize_spec", _check_spec, backend=backend, spec=spec) or spec
    if not _is_attention(new) or new.block_stride_alignment is not None:
        return new
    sizes = supported_kernel_block_sizes(backend, new, plugin_manager=pm)
    fixed = [s for s in sizes if not isinstance(s, MultipleOf)]
    if sizes and len(fixed) == len(sizes):
        new = attrs.evolve(new, block_stride_alignment=MultipleOf(max(fixed)))
    return new


def _is_attention(spec: KVCacheSpec) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    return isinstance(spec, AttentionSpec)


def prepare_kernel_block_sizes(
    kv_cache_config: KVCacheConfig,
    attn_groups: Sequence[Sequence[Any]],
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[int]:
    """The kernel block size of every KV cache group, in order.

    Encoder-only groups are skipped (they hold no pages). State caches and
    specs without layer views keep their block size. Attention groups take
    :func:`select_common_block_size` over their backends, except groups with a
    block-outermost packed tensor (block stride above layer stride): those keep
    the manager size and their backends map their own kernel tables.
    """
    out: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = next(iter(spec.kv_cache_specs.values())) if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        if isinstance(kind, EncoderOnlyAttentionSpec):
            continue
        if not kind.has_layer_views or not isinstance(kind, AttentionSpec):
            out.append(spec.block_size)
            continue
        names = set(group.layer_names)
        packed = any(
            len(t.layers) > 1 and t.block_stride > t.layer_stride
            for t in kv_cache_config.kv_cache_tensors
            if not names.isdisjoint(t.layers)
        )
        if packed:
            out.append(spec.block_size)
            continue
        if gid >= len(attn_groups):
            raise ValueError(
                f"attn_groups has {len(attn_groups)} entries but KV cache group {gid} needs "
                "one; pass build_attention_groups(kv_cache_config, ...)"
            )
        out.append(
            select_common_block_size(
                spec.block_size,
                [g.backend for g in attn_groups[gid]],
                [g.kv_cache_spec for g in attn_groups[gid]],
                plugin_manager=plugin_manager,
            )
        )
    return out
