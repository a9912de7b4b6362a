"""The interface of an elastic cache's memory: address space reserved once as one int8 tensor,
committed and released in whole granules (CPU in ``backing``, CUDA in ``backing_cuda``)."""

from __future__ import annotations

import torch


class BackingMemory:
    """Reserved address space, committed granule by granule (the interface)."""

    size: int  # bytes reserved, a multiple of granularity
    granularity: int  # bytes per granule: the unit of commit and release
    tensor: torch.Tensor  # the reservation's first ``requested`` bytes as one int8 tensor

    def commit(self, start: int, end: int) -> None:
        """Back the granule-aligned ``[start, end)`` with zeroed memory, all or nothing."""
        raise NotImplementedError

    def decommit(self, start: int, end: int) -> None:
        """Give the memory behind the granule-aligned ``[start, end)`` back."""
        raise NotImplementedError

    def check_range(self, start: int, end: int) -> None:
        g = self.granularity
        if start % g or end % g or not 0 <= start < end <= self.size:
            raise ValueError(f"[{start}, {end}) is not a granule-aligned range of "
                             f"this {self.size}-byte reservation (granule {g} bytes)")
