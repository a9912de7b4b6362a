"""A kvcore backend plugin in one module: a kernel that only takes 16-token blocks.

The attention math is borrowed from the ``kvcore-torch`` reference backend;
what this plugin adds is the declaration. Because the kernel accepts exactly
16-token blocks, kvcore splits larger manager blocks (e.g. 64 tokens) into
16-token kernel blocks and maps block tables for it. Its layer-compact
layouts keep every page dense, which that split needs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from kvcore import AttentionBackend, AttentionSpec, KVCacheLayout, KVCacheSpec, hookimpl
from kvcore_torch import TorchAttentionBackend

KERNEL_BLOCK_SIZES = [16]
#: The kernel reads each (head, token) row with 64-byte vector loads.
ROW_ALIGNMENT_BYTES = 64


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
    # Splitting 64-token manager blocks into 16-token kernel blocks needs dense
    # pages: layer-compact layouts have them.
    if backend is not ExampleBackend:
        return None
    return [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC]


@hookimpl
def kvcore_customize_spec(backend: Any, spec: KVCacheSpec) -> KVCacheSpec | None:
    # Pad each (head, token) row of K then V to whole 64-byte vectors; V stays
    # right after K, so any kernel that reads K and V by head size still works.
    if backend is not ExampleBackend or not isinstance(spec, AttentionSpec):
        return None
    row = spec.state_content_size_bytes
    padded = -(-row // ROW_ALIGNMENT_BYTES) * ROW_ALIGNMENT_BYTES
    return None if padded == row else attrs.evolve(spec, state_content_bytes=padded)
