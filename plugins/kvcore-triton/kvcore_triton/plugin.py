"""kvcore hook implementations for the ``triton`` backend (entry point ``triton``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.plugins.hookspecs import hookimpl
from kvcore.memory.layout import KVCacheLayout
from kvcore_triton.backend import TritonAttentionBackend

# NOTE: the kernels take all four view strides, so every layout works; the
# block-compact ones come first (one contiguous run per page).
_KERNEL_BLOCK_SIZES = [16, 32, 64]
_LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC] + [
    layout for layout in KVCacheLayout if layout not in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
]


def _owns(backend: Any) -> bool:
    return backend is TritonAttentionBackend


@hookimpl
def kvcore_register_backends(register: Callable[[type], None]) -> None:
    register(TritonAttentionBackend)


@hookimpl
def kvcore_supported_kernel_block_sizes(backend: Any, spec: Any) -> list[int] | None:
    return list(_KERNEL_BLOCK_SIZES) if _owns(backend) else None


@hookimpl
def kvcore_supported_layouts(backend: Any, spec: Any) -> list[KVCacheLayout] | None:
    return list(_LAYOUTS) if _owns(backend) else None
