"""Building attention groups from a planned config, and their kernel-block views."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pluggy
import torch

from kvcore.runtime.attn_group import AttentionGroup, flatten_attention_groups
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.block_sizes import customize_attention_spec
from kvcore.memory.config import KVCacheConfig
from kvcore.plugins.registry import resolve_backend, resolve_plugin_manager
from kvcore.specs import AttentionSpec


def build_attention_groups(
    kv_cache_config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend] | str],
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[list[AttentionGroup]]:
    """Per KV cache group, one :class:`AttentionGroup` per (backend, customized spec).

    ``layer_backends`` maps every attention layer of the config to a backend
    class or a registered backend name (state-cache layers without one are
    left out). Specs are customized here through the
    plugin hooks; groups keep layer order (a group's layers in config order,
    groups ordered by their first layer). KV cache groups whose spec has no
    layer views get an empty list.
    """
    if not isinstance(layer_backends, Mapping):
        raise TypeError(f"layer_backends must map layer names to backends, got {layer_backends!r}")
    pm = resolve_plugin_manager(plugin_manager)
    out: list[list[AttentionGroup]] = []
    customized: dict[tuple[type[AttentionBackend], Any], Any] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not group.spec_of(group.layer_names[0]).has_layer_views:
            out.append([])
            continue
        by_key: dict[tuple[type[AttentionBackend], Any], AttentionGroup] = {}
        for name in group.layer_names:
            if name not in layer_backends:
                # NOTE: state caches may run without a backend; attention layers may not.
                if not isinstance(group.spec_of(name), AttentionSpec):
                    continue
                raise ValueError(
                    f"attention layer {name!r} (KV cache group {gid}) has no backend in "
                    "layer_backends; map every attention layer of the config to a backend"
                )
            backend = resolve_backend(layer_backends[name], pm)
            layer_spec = group.spec_of(name)
            if (backend, layer_spec) not in customized:
                customized[backend, layer_spec] = customize_attention_spec(
                    backend, layer_spec, plugin_manager=pm
                )
            spec = customized[backend, layer_spec]
            if (backend, spec) in by_key:
                by_key[backend, spec].layer_names.append(name)
            else:
                by_key[backend, spec] = AttentionGroup(backend, [name], spec, gid)
        out.append(list(by_key.values()))
    return out


def map_kv_caches_to_kernel_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    attn_groups: Iterable[AttentionGroup] | Iterable[Iterable[AttentionGroup]],
) -> dict[str, torch.Tensor]:
    """The views kernels read: each split group's layers addressed by kernel blocks.

    ``kv_caches`` (manager-block views, which KV connectors keep using) is not
    changed; layers of groups that do not split blocks keep their view.
    ``attn_groups`` may be flat or nested per KV cache group.
    """
    mapped = dict(kv_caches)
    for group in flatten_attention_groups(attn_groups):
        if group.kernel_block_size is None:
            continue
        for name in group.layer_names:
            if name in kv_caches:
                mapped[name] = group.map_kv_cache_to_kernel_blocks(kv_caches[name])
    return mapped
