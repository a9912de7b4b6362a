"""kvcore hook implementations for the ``flashinfer`` backend (entry point ``flashinfer``).

Nothing here imports FlashInfer: the plugin loads, declares and is listed on
a machine without it (or without a GPU); ``forward`` refuses there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import attrs

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.hookspecs import hookimpl
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs import MultipleOf
from kvcore_flashinfer._runtime import DTYPES, FP8_DTYPES, HEAD_SIZES, MAX_STRIDE_ELEMENTS
from kvcore_flashinfer.backend import FlashInferAttentionBackend

#: Below kvcore-triton's 100: on the H200 its decode read 4.36-4.41 TB/s where FlashInfer's
#: CUDA-core decode read 2.61-2.80 TB/s at the same shape (REAL-CLIENTS.md).
CUDA_PRIORITY = 50
#: Without the FlashInfer package the backend cannot run: below the torch backend's 0.
MISSING_PRIORITY = -1000
#: FlashInfer reads page, token and head strides as given (``paged_kv_t``), so every layout
#: whose strides fit in 32 bits works; block-compact ones first (a page is one run).
_LAYOUTS = [
    KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC,
    KVCacheLayout.BLHNC, KVCacheLayout.BHLNC, KVCacheLayout.LHBNC,
]
REQUIREMENTS = KernelRequirements(
    devices=("cuda",),
    dtypes=DTYPES,
    head_sizes=HEAD_SIZES,
    max_stride_elements=MAX_STRIDE_ELEMENTS,
    # NOTE: its kernels copy K/V with 16-byte cp.async loads.
    alignment_bytes=16,
    # NOTE: fp8 pages with one scale per layer (kv_data_type, k_scale, v_scale); no per-token scales.
    kv_quant=("none", "per_tensor"),
)


def _owns(backend: Any) -> bool:
    return backend is FlashInferAttentionBackend


@hookimpl
def kvcore_register_backends(register: Callable[[type], None]) -> None:
    register(FlashInferAttentionBackend)


@hookimpl
def kvcore_supported_kernel_block_sizes(backend: Any, spec: Any) -> list[Any] | None:
    # NOTE: any page size (FlashInfer takes page_size at plan time); no preferred size.
    return [MultipleOf(1)] if _owns(backend) else None


@hookimpl
def kvcore_supported_layouts(backend: Any, spec: Any) -> list[KVCacheLayout] | None:
    return list(_LAYOUTS) if _owns(backend) else None


@hookimpl
def kvcore_kernel_requirements(backend: Any, spec: Any) -> KernelRequirements | None:
    if not _owns(backend):
        return None
    quantized = getattr(spec, "kv_quant", None) is not None
    return attrs.evolve(REQUIREMENTS, dtypes=FP8_DTYPES) if quantized else REQUIREMENTS


@hookimpl
def kvcore_backend_priority(backend: Any, spec: Any, device: Any) -> int | None:
    if not _owns(backend):
        return None
    if importlib.util.find_spec("flashinfer") is None:
        return MISSING_PRIORITY
    return CUDA_PRIORITY if device.type == "cuda" else -1
