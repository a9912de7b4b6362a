"""Building attention groups from a planned config, and their kernel-block views."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pluggy
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.negotiation import Negotiation, backend_groups
from kvcore.runtime.attn_group import AttentionGroup, flatten_attention_groups


def build_attention_groups(
    kv_cache_config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend] | str],
    *,
    plugin_manager: pluggy.PluginManager | None = None,
) -> list[list[AttentionGroup]]:
    """Per KV cache group, one :class:`AttentionGroup` per (backend, customized spec).

    ``layer_backends`` maps every attention layer of the config to a backend
    class or a registered backend name (state-cache layers without one are
    left out). Specs are customized here through the plugin hooks (for a
    config planned from raw specs). Each group's record holds backend,
    layers and spec; ``create_metadata_builders(kernel_block_size=...)``
    settles its kernel blocks. ``KVCache.create`` builds its groups from its
    complete negotiation record instead (:func:`attention_groups_from`).
    Groups keep layer order (a group's layers in config order, groups ordered
    by their first layer). KV cache groups whose spec has no layer views get
    an empty list.
    """
    if not isinstance(layer_backends, Mapping):
        raise TypeError(f"layer_backends must map layer names to backends, got {layer_backends!r}")
    answers = HookAnswers(plugin_manager)
    classes = {name: answers.backend(backend) for name, backend in layer_backends.items()}
    return [
        [AttentionGroup(backend, names, spec, gid) for (backend, spec), names in by_key.items()]
        for gid, by_key in enumerate(backend_groups(kv_cache_config, classes, answers, customize=True))
    ]


def attention_groups_from(negotiation: Negotiation) -> list[list[AttentionGroup]]:
    """The attention groups a negotiation decided, one list per KV cache group."""
    return [
        [AttentionGroup.from_negotiation(record, group.group_id) for record in group.backends]
        for group in negotiation.groups
    ]


def map_kv_caches_to_kernel_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    attn_groups: Iterable[AttentionGroup] | Iterable[Iterable[AttentionGroup]],
) -> dict[str, torch.Tensor]:
    """The views kernels read: each split group's layers addressed by kernel blocks.

    ``kv_caches`` (the views as allocated, which KV connectors keep using) is
    not changed; layers of groups that do not split blocks keep their view,
    and so do dense groups, which were split at allocation. ``attn_groups``
    may be flat or nested per KV cache group.
    """
    mapped = dict(kv_caches)
    for group in flatten_attention_groups(attn_groups):
        if group.kernel_block_size is None:
            continue
        for name in group.layer_names:
            if name in kv_caches:
                mapped[name] = group.map_kv_cache_to_kernel_blocks(kv_caches[name])
    return mapped
