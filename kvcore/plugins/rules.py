"""Every kernel view of a plan held to its backend's memory rules (``KernelRequirements``), over a
``meta`` buffer before anything is allocated; each check also knows which strides grow with the
block size, so a refusal can name a block size that would meet the rules without planning again."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import attrs
import torch

from kvcore.memory.config import KVCacheConfig
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.answers import label
from kvcore.plugins.negotiation import GroupNegotiation, Negotiation
from kvcore.plugins.requirements import KernelRequirements

_N = 3  # NOTE: the logical index of N (tokens' states) in [L, B, H, N, C]


def kernel_views(config: KVCacheConfig, groups: Sequence[GroupNegotiation]) -> dict[str, torch.Tensor]:
    """Every layer's kernel view of the plan, over a ``meta`` buffer (nothing allocated)."""
    sizes = [g.kernel_block_size if g.ratio > 1 else None for g in groups]
    return Negotiation(tuple(groups)).kernel_views(allocate_kv_cache(config, torch.device("meta"), None, sizes))


@attrs.frozen
class ViewCheck:
    """One layer's kernel view (strides in elements, offset in bytes) and the rules it must meet;
    ``scaling``: which strides (and the offset) grow in proportion to the block size."""

    backend: str
    layer: str
    layout: str
    requirements: KernelRequirements
    strides: tuple[int, ...]
    itemsize: int
    offset: int
    scaling: tuple[bool, ...]

    def violation(self, factor: Fraction | int = 1) -> str | None:
        """The first rule the view breaks (with blocks ``factor`` times as large), in words."""
        strides = [s * factor if grows else s for s, grows in zip(self.strides, self.scaling)]
        offset = self.offset * factor
        if any(Fraction(v).denominator != 1 for v in (*strides, offset)):
            return "its pages do not split evenly"
        found = self.requirements.view_violation([int(s) for s in strides], self.itemsize, int(offset))
        if found is None:
            return None
        rule, value, needed = found
        return (f"backend {self.backend!r} cannot read layer {self.layer!r} in "
                f"layout {self.layout}: rule {rule} needs {needed}, got {value}")


def view_checks(config: KVCacheConfig, groups: Sequence[GroupNegotiation]) -> list[ViewCheck]:
    """A check per kernel view whose backend has memory rules (none: no view is built)."""
    entries = [e for g in groups for e in g.backends if e.requirements.has_memory_rules]
    views = kernel_views(config, groups) if entries else {}
    order = config.layout.stride_order
    scaling = tuple(order.index(_N) > order.index(d) for d in range(1, 5))
    checks = []
    for entry in entries:
        for name in entry.layer_names:
            view = views.get(name)
            if view is not None and view.dim() == 4:
                size = view.element_size()
                checks.append(ViewCheck(label(entry.backend), name, config.layout.name, entry.requirements,
                                        tuple(view.stride()), size, view.storage_offset() * size, scaling))
    return checks
