"""kvcore's exceptions and warnings; every error is also a ``ValueError`` (bad input, refused)."""

from __future__ import annotations


class KVCoreError(ValueError):
    """Base class of kvcore's own errors."""


class PluginError(KVCoreError):
    """A plugin failed to import, raised in a hook or returned a wrong type (named)."""


class KernelRequirementError(KVCoreError):
    """A kernel view of a plan breaks a rule its backend declared (``KernelRequirements``)."""


class InsufficientMemoryError(KVCoreError):
    """Memory for KV cache blocks cannot be committed (an elastic cache's grow); nothing changed."""


class PluginWarning(UserWarning):
    """A plugin was skipped (for example, its entry point failed to import)."""


class OutOfBlocksError(KVCoreError):
    """A block pool cannot satisfy an allocation; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        self.requested, self.free = requested, free
        super().__init__(f"cannot allocate {requested} KV cache blocks: only {free} are free. Free finished "
                         "sequences' blocks, lower the batch size, or plan the cache with more memory.")
