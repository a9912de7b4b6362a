"""A kvcore backend plugin in one module: a kernel that only takes 16-token blocks.

The attention math is borrowed from the ``kvcore-torch`` reference backend;
what this plugin adds is the declaration. Because the kernel accepts exactly
16-token blocks, kvcore splits larger manager blocks (e.g. 64 tokens) into
16-token kernel blocks and maps block tables for it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvcore import AttentionBackend, KVCacheLayout, hookimpl
from kvcore_torch import TorchAttentionBackend

KERNEL_BLOCK_SIZES = [16]


class ExampleBackend(AttentionBackend):
    """Paged attention over 16-token kernel blocks (computed by kvcore-torch)."""

    name: ClassVar[str] = "example"
    forward = staticmethod(TorchAttentionBackend.forward)


@hookimpl
def kvcore_register_backends(register: Any) -> None:
    register(ExampleBackend)


@hookimpl
def kvcore_supported_kernel_block_sizes(backend: Any, spec: Any) -> list[int] | None:
    # Answer only for our own backend: None lets other plugins answer for theirs.
    return list(KERNEL_BLOCK_SIZES) if backend is ExampleBackend else None


@hookimpl
def kvcore_supported_layouts(backend: Any, spec: Any) -> list[KVCacheLayout] | None:
    # Splitting blocks needs dense pages, so prefer layer-compact layouts.
    if backend is not ExampleBackend:
        return None
    return [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC]
