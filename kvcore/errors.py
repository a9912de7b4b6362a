"""Exceptions and warnings raised by kvcore.

Every error is also a ``ValueError`` so that callers who only know the
standard library still catch kvcore's refusals of bad input.
"""

from __future__ import annotations


class KVCoreError(ValueError):
    """Base class of kvcore's own errors."""


class PluginError(KVCoreError):
    """A plugin failed to import, raised inside a hook, or returned a wrong type.

    The message always names the entry point, its distribution and version,
    and the hook involved.
    """


class KernelRequirementError(KVCoreError):
    """A kernel view of a plan breaks a rule its backend declared (``KernelRequirements``).

    Raised before anything is allocated; the message names the backend, the
    layer, the rule, the value and a remedy when one exists.
    """


class PluginWarning(UserWarning):
    """A plugin was skipped (for example, its entry point failed to import)."""


class OutOfBlocksError(KVCoreError):
    """A block pool cannot satisfy an allocation; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        self.requested = requested
        self.free = free
        super().__init__(
            f"cannot allocate {requested} KV cache blocks: only {free} are free. "
            "Free finished sequences' blocks, lower the batch size, or plan "
            "the cache with more memory."
        )
