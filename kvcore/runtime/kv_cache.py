"""KVCache: the whole path from layer specs to zeroed, kernel-ready views: negotiate (one stage
decides what every layer gets), allocate, wire; every stage after negotiation reads its record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pluggy
import torch

from kvcore.memory.allocation import allocate_cache_memory
from kvcore.memory.config import KVCacheConfig
from kvcore.memory.elastic import ElasticMemory, checked_num_blocks
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.views import checked_device
from kvcore.plugins.backend import AttentionBackend, CommonAttentionMetadata
from kvcore.plugins.mixer_backend import MixerBackend, is_mixer_backend
from kvcore.plugins.negotiate import negotiate
from kvcore.plugins.negotiation import Negotiation
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.runtime.block_pool import BlockPool
from kvcore.runtime.quant import layer_metadata, per_tensor_scales, quant_states
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.settings import Settings
from kvcore.specs import KVCacheSpec


@attrs.define(eq=False)
class KVCache:
    """A planned, allocated KV cache with everything an engine needs per step.

    ``kv_caches`` are the views as allocated (KV connectors use them), ``layer_kv_caches``
    the views kernels take; ``attn_groups[g]`` are KV cache group ``g``'s attention groups.
    Quantized: ``scale_caches`` (per-token-head layers' float32 ``[B, H, N, 2]`` K and V scales,
    addressed like ``kv_caches``), ``kv_scales`` (per-tensor layers' ``(k, v)``).
    Call :meth:`begin_step` once per step, after allocating blocks and before kernels run.
    """

    config: KVCacheConfig
    layout: KVCacheLayout
    attn_groups: list[list[AttentionGroup]]
    kv_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    layer_kv_caches: dict[str, torch.Tensor] = attrs.field(repr=False)
    block_pool: BlockPool
    zeroer: KVBlockZeroer = attrs.field(repr=False)
    device: torch.device
    max_num_seqs: int
    max_model_len: int
    negotiation: Negotiation = attrs.field(repr=False)
    elastic: ElasticMemory | None = attrs.field(repr=False)  # NOTE: None: a plain allocation
    settings: Settings = attrs.field(repr=False)  # NOTE: read once, in create
    scale_caches: dict[str, torch.Tensor] = attrs.field(factory=dict, repr=False)
    kv_scales: dict[str, tuple[float, float]] = attrs.field(factory=dict)
    quant_states: dict[str, Any] = attrs.field(factory=dict, repr=False)  # NOTE: into each layer's metadata
    #: Each mixer layer's backend (layers ``layer_backends`` mapped to a ``MixerBackend``).
    mixer_backends: dict[str, type[MixerBackend]] = attrs.field(factory=dict, repr=False)
    #: With separate state pages, the state groups' own block pool and zeroer (else None).
    state_pool: BlockPool | None = None
    state_zeroer: KVBlockZeroer | None = attrs.field(default=None, repr=False)

    @classmethod
    def create(cls, layer_specs: Mapping[str, KVCacheSpec], layer_backends: Mapping[str, type[AttentionBackend] | str],
               *, device: torch.device | str, layout: KVCacheLayout | str | None = None,
               available_memory: int | None = None, num_blocks: int | None = None, max_num_seqs: int,
               max_model_len: int, plugin_manager: pluggy.PluginManager | None = None, group: Any = None,
               max_num_blocks: int | None = None, enable_prefix_caching: bool = False, kv_cache_dtype: str = "auto",
               separate_state_pages: bool = False, num_state_blocks: int | None = None) -> KVCache:
        """Plan, allocate and wire a KV cache for ``layer_specs`` (model order).

        ``layer_backends`` maps each attention layer to a backend class, a registered name or ``"auto"``. Give
        one of ``available_memory`` (bytes) and ``num_blocks``. With a ``torch.distributed`` ``group`` all ranks
        agree on one layout and block count. With ``max_num_blocks`` the cache is elastic: planned for that many
        blocks, memory committed for ``num_blocks`` (or what ``available_memory`` buys; neither: all), changed
        later by :meth:`resize`. ``kv_cache_dtype`` other than "auto" stores attention layers quantized
        (docs/quantized-cache.md). ``separate_state_pages``: state caches in a region of their own,
        ``num_state_blocks`` blocks (default: a slot per sequence, twice that with prefix caching) with a pool of
        their own (:attr:`state_pool`). The stages: :func:`kvcore.negotiate` decides, then the cache is
        allocated and wired from its record.
        """
        settings = Settings.from_env()
        negotiation = negotiate(layer_specs, layer_backends, device=checked_device(device), layout=layout,
                                available_memory=available_memory, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, plugin_manager=plugin_manager, group=group,
                                max_num_blocks=max_num_blocks, enable_prefix_caching=enable_prefix_caching,
                                settings=settings, kv_cache_dtype=kv_cache_dtype,
                                separate_state_pages=separate_state_pages, num_state_blocks=num_state_blocks)
        config, device = negotiation.config, negotiation.device
        rows, pages = negotiation.rows_per_block(), negotiation.kernel_pages()
        memory = allocate_cache_memory(config, device, negotiation.allocation_kernel_block_sizes, rows, pages,
                                       negotiation.num_blocks if negotiation.elastic else None)
        scales = per_tensor_scales(config)
        quant = quant_states(config, memory.scale_caches, scales)
        pool = BlockPool(negotiation.num_blocks, enable_caching=enable_prefix_caching)
        state_pool = state_zeroer = None
        # NOTE: on a CPU the interpreted kernel zeroes hundreds of times slower than indexed fills
        zeroing = "torch" if device.type == "cpu" else "auto"
        if memory.states:  # NOTE: a separate state region: its own pool and zeroer
            state_pool = BlockPool(config.num_state_blocks, enable_caching=enable_prefix_caching)
            state_zeroer = KVBlockZeroer.from_views(device, memory.states, config.num_state_blocks, backend=zeroing,
                                                    settings=settings)
        attn_groups = [[AttentionGroup.from_record(r, g.group_id) for r in g.backends] for g in negotiation.groups]
        for attn_group in (a for groups in attn_groups for a in groups):
            attn_group.create_metadata_builders(device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                settings=settings)
        zeroer = KVBlockZeroer.from_views(device, memory.paged, config.num_blocks, backend=zeroing, settings=settings)
        zeroer.num_blocks = negotiation.num_blocks
        mixers = {n: b for n, b in negotiation.layer_backends.items() if is_mixer_backend(b)}
        return cls(config, negotiation.layout, attn_groups, memory.kv_caches, memory.kernel_views, pool, zeroer,
                   device, max_num_seqs, max_model_len, negotiation, memory.elastic, settings, memory.scale_caches,
                   scales, quant, mixers, state_pool, state_zeroer)

    def load_kv_scales(self, modules: Mapping[str, Any]) -> None:
        """Per-tensor scales from the ``k_scale`` / ``v_scale`` attributes (floats or 0-d
        tensors) of each layer's attention module in ``modules`` (layer name -> module); a
        missing attribute means 1.0. Call it before the first step writes the cache."""
        self.kv_scales = per_tensor_scales(self.config, modules)
        self.quant_states = quant_states(self.config, self.scale_caches, self.kv_scales)

    @property
    def kernel_block_sizes(self) -> list[int]:
        """One kernel block size per KV cache group with pages."""
        return self.negotiation.kernel_block_sizes

    @property
    def num_blocks(self) -> int:
        """Blocks usable now (the null block included); below ``max_num_blocks`` when shrunk."""
        return self.config.num_blocks if self.elastic is None else self.elastic.num_blocks

    @property
    def max_num_blocks(self) -> int:
        """Blocks the address space is reserved for (``num_blocks`` for a plain cache)."""
        return self.config.num_blocks

    @property
    def committed_bytes(self) -> int:
        """Bytes of the allocation backed by memory now."""
        if self.elastic is not None:
            return self.elastic.committed_bytes
        return self.config.kv_cache_tensors[0].size if self.config.kv_cache_tensors else 0

    def resize(self, num_blocks: int) -> None:
        """Grow or shrink an elastic cache to ``num_blocks`` blocks in place, all or nothing
        (an exception or Ctrl-C at any point leaves memory, pool and zeroer at the old size).

        No live byte moves; shrinking refuses while blocks at or above ``num_blocks`` are held.
        """
        if self.elastic is None:
            raise ValueError("this KVCache is not elastic; create it with "
                             "KVCache.create(..., max_num_blocks=M) to resize it")
        num_blocks = checked_num_blocks(num_blocks, self.max_num_blocks)
        old, elastic, pool = self.num_blocks, self.elastic, self.block_pool
        try:
            if num_blocks > old:
                elastic.resize(num_blocks)  # NOTE: may fail (no memory) before the pool changes
                pool.resize(num_blocks)
            elif num_blocks < old:
                pool.resize(num_blocks)  # NOTE: refuses while blocks above are held
                elastic.resize(num_blocks)
        except BaseException:  # NOTE: Ctrl-C too: memory back at ``old``, the pool never beyond it
            try:
                if elastic.num_blocks != old:
                    elastic.resize(old)
            finally:
                backed = min(old, elastic.num_blocks)
                if pool.num_blocks != backed:
                    pool.resize(backed)
                self.zeroer.num_blocks = backed
            raise
        self.zeroer.num_blocks = num_blocks

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

    def pool_of(self, group_id: int) -> BlockPool:
        """The pool KV cache group ``group_id`` takes its blocks from."""
        return self.state_pool if self.config.in_state_region(group_id) else self.block_pool

    def begin_step(self) -> list[int]:
        """Zero every block allocated since the last step, one launch per pool that has new
        blocks; returns their ids (the block pool's, then the state pool's).

        When zeroing raises (a failed launch, Ctrl-C) the blocks stay pending for the next call.
        """
        zeroed = []
        for pool, zeroer in ((self.block_pool, self.zeroer), (self.state_pool, self.state_zeroer)):
            new_blocks = pool.take_new_blocks() if pool is not None else []
            if new_blocks:
                try:
                    zeroer.zero_block_ids(new_blocks)
                except BaseException:
                    pool.requeue_new_blocks(new_blocks)
                    raise
            zeroed += new_blocks
        return zeroed

    def build_metadata(self, common: list[CommonAttentionMetadata], ubatch_idx: int = 0) -> dict[str, Any]:
        """Each layer's backend metadata for one step (``common[g]``: group ``g``'s batch)."""
        if not isinstance(common, (list, tuple)):
            raise TypeError(f"common must be a list of CommonAttentionMetadata, one per KV cache group, got "
                            f"{type(common).__name__}")
        if len(common) != self.num_groups:
            raise ValueError(f"got {len(common)} common metadata objects for {self.num_groups} KV cache groups; pass "
                             "one per group (each with that group's block table)")
        for group_id, item in enumerate(common):
            if not isinstance(item, CommonAttentionMetadata):
                raise TypeError(f"common[{group_id}] is a {type(item).__name__} ({item!r:.60}), not a "
                                "CommonAttentionMetadata; build one per KV cache group with "
                                "kvcore.plugins.backend.CommonAttentionMetadata(...)")
        out: dict[str, Any] = {}
        for group_id, groups in enumerate(self.attn_groups):
            for attn_group in groups:
                metadata = attn_group.build_metadata(common[group_id], ubatch_idx)
                out.update(layer_metadata(metadata, attn_group.layer_names, self.quant_states))
        return out
