"""The frozen records a negotiation leaves behind, one per KV cache group.

:func:`kvcore.plugins.negotiation.negotiate` makes them; the allocator,
attention groups, metadata builders and zeroer read them and never ask the
plugin hooks again.
"""

from __future__ import annotations

import attrs

from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.specs import KVCacheSpec


@attrs.frozen
class BackendNegotiation:
    """One attention group's answer: its backend, layers, spec and kernel blocks.

    ``kernel_block_size`` is None when kernel blocks equal manager blocks.
    ``kernel_block_stride`` is 0 when the kernel blocks of manager block ``b``
    are ``b * ratio + j`` (dense pages), else the kernel pages between two
    blocks of a packed cache (``b * stride + j``). ``requirements`` is what
    the backend's ``kvcore_kernel_requirements`` answered for the spec.
    """

    backend: type[AttentionBackend]
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    group_kernel_block_size: int | None
    kernel_block_size: int | None = None
    kernel_block_stride: int = 0
    requirements: KernelRequirements = NO_REQUIREMENTS


@attrs.frozen
class GroupNegotiation:
    """What one KV cache group was negotiated to.

    ``kernel_block_size`` is the group's (None for a group without pages);
    ``ratio`` is how many consecutive rows of each view *as allocated* make one
    manager block (> 1 only for a dense group split at allocation).
    """

    group_id: int
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    kernel_block_size: int | None
    ratio: int
    has_pages: bool
    backends: tuple[BackendNegotiation, ...]


@attrs.frozen
class Negotiation:
    """One :class:`GroupNegotiation` per KV cache group of a plan, in group order."""

    groups: tuple[GroupNegotiation, ...]

    @property
    def kernel_block_sizes(self) -> list[int]:
        """One kernel block size per group that has pages (``prepare_kernel_block_sizes``' list)."""
        return [g.kernel_block_size for g in self.groups if g.kernel_block_size is not None]

    @property
    def allocation_kernel_block_sizes(self) -> list[int | None]:
        """Per group, what ``allocate_kv_cache`` splits views by (None: keep blocks)."""
        return [g.kernel_block_size if g.ratio > 1 else None for g in self.groups]

    def rows_per_block(self) -> dict[str, int]:
        """Layer name -> rows of its allocated view per manager block, for layers with pages."""
        return {
            name: g.ratio
            for g in self.groups
            if g.has_pages and g.kv_cache_spec.has_layer_views
            for name in g.layer_names
        }
