"""KVCache: the whole path from layer specs to zeroed, kernel-ready views.

One call resolves the layout, lets each backend customize its layers' specs,
plans the allocation, builds attention groups, picks kernel block sizes,
allocates, maps kernel views, builds metadata builders and the zeroer. The
result is what an engine's model runner keeps for its lifetime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import pluggy
import torch

from kvcore._validate import positive_int
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.plugins.backend import AttentionBackend, CommonAttentionMetadata
from kvcore.runtime.block_pool import BlockPool
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.layout import KVCacheLayout
from kvcore.specs import AttentionSpec, EncoderOnlyAttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from kvcore.runtime.zeroer import KVBlockZeroer


def _backend_classes(
    layer_specs: Mapping[str, KVCacheSpec],
    layer_backends: Mapping[str, type[AttentionBackend] | str],
    pm: pluggy.PluginManager,
) -> dict[str, type[AttentionBackend]]:
    """``layer_backends`` with registered backend names replaced by their classes."""
    from kvcore.plugins.registry import resolve_backend

    if not isinstance(layer_specs, Mapping):
        raise TypeError(f"layer_specs must map layer names to KVCacheSpecs, got {layer_specs!r}")
    if not isinstance(layer_backends, Mapping):
        raise TypeError(f"layer_backends must map layer names to backends, got {layer_backends!r}")
    unknown = sorted(set(layer_backends) - set(layer_specs))
    if unknown:
        raise ValueError(f"layer_backends names layers without a spec: {unknown}; add their specs")
    missing = [n for n, s in layer_specs.items() if isinstance(s, AttentionSpec) and n not in layer_backends]
    if missing:
        raise ValueError(f"attention layers {missing} have no backend; add them to layer_backends")
    return {layer: resolve_backend(backend, pm) for layer, backend in layer_backends.items()}


@attrs.define(eq=False)
class KVCache:
    """A planned, allocated KV cache with everything an engine needs per step.

    ``kv_caches`` are the views as allocated, which KV connectors and offload
    keep using (groups of dense pages are already split into kernel blocks
    there; packed groups stay addressed by manager block). ``layer_kv_caches``
    are the views attention kernels take, addressed by kernel block.
    ``attn_groups[g]`` holds the attention groups of KV cache group ``g``;
    :meth:`build_metadata` maps each group's manager block table to kernel
    blocks. ``block_pool`` hands out manager block ids; call
    :meth:`begin_step` once per step, after allocating and before any kernel
    reads the new blocks.
    """

    config: KVCacheConfig
    layout: KVCacheLayout
    attn_groups: list[list[AttentionGroup]]
    kernel_block_sizes: list[int]
    kv_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    layer_kv_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    block_pool: BlockPool
    zeroer: KVBlockZeroer = attrs.field(repr=False)
    device: torch.device
    max_num_seqs: int
    max_model_len: int

    @classmethod
    def create(
        cls,
        layer_specs: Mapping[str, KVCacheSpec],
        layer_backends: Mapping[str, type[AttentionBackend] | str],
        *,
        device: torch.device | str,
        layout: KVCacheLayout | str | None = None,
        available_memory: int | None = None,
        num_blocks: int | None = None,
        max_num_seqs: int,
        max_model_len: int,
        plugin_manager: pluggy.PluginManager | None = None,
        group: Any = None,
    ) -> KVCache:
        """Plan, allocate and wire a KV cache for ``layer_specs`` (model order).

        ``layer_backends`` maps each attention layer to its backend class or
        registered backend name. Give exactly one of ``available_memory``
        (bytes) and ``num_blocks``. With a ``torch.distributed`` process
        ``group``, all ranks agree on one layout and one block count.
        """
        from kvcore.plugins.block_sizes import customize_attention_spec, prepare_kernel_block_sizes
        from kvcore.runtime.group_builder import build_attention_groups, map_kv_caches_to_kernel_blocks
        from kvcore.plugins.layouts import local_supported_layouts, resolve_kv_cache_layout
        from kvcore.memory.planner import plan_kv_cache
        from kvcore.plugins.registry import resolve_plugin_manager
        from kvcore.memory.views import allocate_kv_cache
        from kvcore.runtime.zeroer import KVBlockZeroer

        device = torch.device(device)
        max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        max_model_len = positive_int("max_model_len", max_model_len)
        pm = resolve_plugin_manager(plugin_manager)
        specs = dict(layer_specs)
        backends = _backend_classes(specs, layer_backends, pm)
        # NOTE: specs are customized before planning so that the planner sees
        # each backend's block stride alignment.
        specs.update(
            (name, customize_attention_spec(backends[name], spec, plugin_manager=pm))
            for name, spec in specs.items()
            if name in backends and isinstance(spec, AttentionSpec)
        )
        pairs = list(dict.fromkeys((b, specs[n]) for n, b in backends.items()))
        supported = local_supported_layouts(
            [b for b, _ in pairs], [s for _, s in pairs], plugin_manager=pm
        )
        if group is not None:
            from kvcore.distributed import agree_layout, agree_num_blocks

            layout = agree_layout(supported, specs.values(), group, layout)
            if num_blocks is None:
                probe = plan_kv_cache(specs, layout, available_memory=available_memory)
                num_blocks, available_memory = probe.num_blocks, None
            num_blocks = agree_num_blocks(num_blocks, group)
        else:
            layout = resolve_kv_cache_layout([supported], specs.values(), layout)
        config = plan_kv_cache(specs, layout, available_memory=available_memory, num_blocks=num_blocks)
        attn_groups = build_attention_groups(config, backends, plugin_manager=pm)
        kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups, plugin_manager=pm)
        # NOTE: kernel_block_sizes skips encoder-only groups; per_group is indexed by group id.
        per_group = _per_group_kernel_sizes(config, kernel_block_sizes)
        kv_caches = allocate_kv_cache(config, device, layout, per_group)
        for group_id, groups in enumerate(attn_groups):
            for attn_group in groups:
                attn_group.create_metadata_builders(
                    device,
                    max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len,
                    kernel_block_size=per_group[group_id],
                    plugin_manager=pm,
                )
        flat = [g for groups in attn_groups for g in groups]
        layer_kv_caches = map_kv_caches_to_kernel_blocks(kv_caches, flat)
        zeroer = KVBlockZeroer(
            device, flat + _unserved_groups(config, attn_groups), per_group, layer_kv_caches, config.num_blocks
        )
        return cls(
            config=config,
            layout=layout,
            attn_groups=attn_groups,
            kernel_block_sizes=kernel_block_sizes,
            kv_caches=kv_caches,
            layer_kv_caches=layer_kv_caches,
            block_pool=BlockPool(config.num_blocks),
            zeroer=zeroer,
            device=device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_groups(self) -> int:
        """KV cache groups: each needs its own block table per sequence."""
        return len(self.config.kv_cache_groups)

    def block_size(self, group_id: int) -> int:
        """Tokens per manager block of KV cache group ``group_id``."""
        return self.config.kv_cache_groups[group_id].kv_cache_spec.block_size

    def group_of(self, layer_name: str) -> AttentionGroup:
        """The attention group serving ``layer_name``."""
        for groups in self.attn_groups:
            for attn_group in groups:
                if layer_name in attn_group.layer_names:
                    return attn_group
        raise ValueError(f"layer {layer_name!r} is in no attention group; layers: {self.config.layer_names}")

    def begin_step(self) -> list[int]:
        """Zero every block allocated since the last step, in one launch; returns their ids."""
        new_blocks = self.block_pool.take_new_blocks()
        if new_blocks:
            self.zeroer.zero_block_ids(new_blocks)
        return new_blocks

    def build_metadata(self, common: list[CommonAttentionMetadata], ubatch_idx: int = 0) -> dict[str, Any]:
        """Each layer's backend metadata for one step.

        ``common[g]`` describes the batch with KV cache group ``g``'s manager
        block table; each attention group maps it to kernel blocks.
        """
        if len(common) != self.num_groups:
            raise ValueError(
                f"got {len(common)} common metadata objects for {self.num_groups} KV cache "
                "groups; pass one per group (each with that group's block table)"
            )
        out: dict[str, Any] = {}
        for group_id, groups in enumerate(self.attn_groups):
            for attn_group in groups:
                metadata = attn_group.build_metadata(common[group_id], ubatch_idx)
                out.update(dict.fromkeys(attn_group.layer_names, metadata))
        return out


def _unserved_groups(config: KVCacheConfig, attn_groups: list[list[AttentionGroup]]) -> list[AttentionGroup]:
    """Zeroer-only groups for KV cache groups no backend serves (state caches).

    Their blocks are handed out by the same pool and must be zeroed too.
    """
    return [
        AttentionGroup(AttentionBackend, group.layer_names, group.kv_cache_spec, group_id)
        for group_id, (group, served) in enumerate(zip(config.kv_cache_groups, attn_groups))
        if not served
        and group.kv_cache_spec.has_layer_views
        and not isinstance(group.kv_cache_spec, EncoderOnlyAttentionSpec)
    ]


def _per_group_kernel_sizes(config: KVCacheConfig, kernel_block_sizes: list[int]) -> list[int | None]:
    """Kernel block size per KV cache group (None for encoder-only groups, which get none)."""
    sizes = iter(kernel_block_sizes)
    return [
        None if isinstance(g.spec_of(g.layer_names[0]), EncoderOnlyAttentionSpec) else next(sizes)
        for g in config.kv_cache_groups
    ]
