"""kvcore hook implementations for the ``triton`` backend (entry point ``triton``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.hookspecs import hookimpl
from kvcore.plugins.requirements import KernelRequirements
from kvcore_triton import _checks
from kvcore_triton._checks import DTYPES
from kvcore_triton.backend import TritonAttentionBackend
from kvcore_triton.mixers import TritonMixerBackend

# NOTE: the first size is the one the backend prefers (64 measured fastest on
# the H200); the kernels take all four view strides, so every layout works;
# the block-compact ones come first (one contiguous run per page).
_KERNEL_BLOCK_SIZES = [64, 32, 16]
#: Head sizes are padded to a power of two inside the kernels; 256 is the widest tried.
_HEAD_SIZES = tuple(range(1, 257))
#: Above the torch backend's 0 (and other CUDA plugins'): on the H200 these
#: kernels decode ~1.07x faster than FlashInfer's; on the CPU interpreter they
#: are slow, so the torch backend wins there.
CUDA_PRIORITY = 100
#: Every cache quantization kvcore stores, and the 8-bit dtypes it stores them in.
_KV_QUANT = ("none", "per_tensor", "per_token_head")
QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC] + [
    layout for layout in KVCacheLayout if layout not in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
]


def _owns(backend: Any) -> bool:
    return backend is TritonAttentionBackend


@hookimpl
def kvcore_register_backends(register: Callable[[type], None]) -> None:
    register(TritonAttentionBackend)
    register(TritonMixerBackend)


@hookimpl
def kvcore_supported_kernel_block_sizes(backend: Any, spec: Any) -> list[int] | None:
    return list(_KERNEL_BLOCK_SIZES) if _owns(backend) else None


@hookimpl
def kvcore_supported_layouts(backend: Any, spec: Any) -> list[KVCacheLayout] | None:
    return list(_LAYOUTS) if _owns(backend) else None


@hookimpl
def kvcore_kernel_requirements(backend: Any, spec: Any) -> KernelRequirements | None:
    devices = None if _checks.INTERPRETED else ("cuda",)  # NOTE: interpreted, the kernels run on any device
    note = None if _checks.INTERPRETED else _checks.cpu_note()
    if backend is TritonMixerBackend:
        return KernelRequirements(devices=devices, dtypes=DTYPES, note=note)
    if not _owns(backend):
        return None
    # NOTE: a quantized cache stores 8-bit values the kernels widen in registers.
    dtypes = DTYPES if getattr(spec, "kv_quant", None) is None else QUANT_DTYPES
    return KernelRequirements(devices=devices, dtypes=dtypes, head_sizes=_HEAD_SIZES, kv_quant=_KV_QUANT,
                              note=note)


@hookimpl
def kvcore_backend_priority(backend: Any, spec: Any, device: Any) -> int | None:
    if not _owns(backend) and backend is not TritonMixerBackend:
        return None
    # NOTE: a broken interpreter, when on, runs CUDA tensors' kernels too: then "auto" picks another
    return CUDA_PRIORITY if device.type == "cuda" and not _checks.INTERPRETER_PROBLEM else -1
