"""kvcore hook implementations for the ``torch`` backend (entry point ``torch``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.hookspecs import hookimpl
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs import MultipleOf
from kvcore_torch.backend import TorchAttentionBackend
from kvcore_torch.mixers import TorchMixerBackend

# NOTE: views carry the layout in their strides, so every layout works. The
# backend states no memory rules (it reads every quantization) and keeps the
# core priority 0: it is the fallback "auto" picks where no faster backend can
# run (the CPU).
_LAYOUTS = [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC] + [
    layout for layout in KVCacheLayout if layout not in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
]


def _owns(backend: Any) -> bool:
    return backend is TorchAttentionBackend


@hookimpl
def kvcore_register_backends(register: Callable[[type], None]) -> None:
    register(TorchAttentionBackend)
    register(TorchMixerBackend)  # NOTE: the reference for every mixer; priority 0, no requirements


@hookimpl
def kvcore_supported_kernel_block_sizes(backend: Any, spec: Any) -> list[MultipleOf] | None:
    return [MultipleOf(1)] if _owns(backend) else None


@hookimpl
def kvcore_supported_layouts(backend: Any, spec: Any) -> list[KVCacheLayout] | None:
    return list(_LAYOUTS) if _owns(backend) else None


#: Every cache quantization kvcore stores: the reference reads them all.
REQUIREMENTS = KernelRequirements(kv_quant=("none", "per_tensor", "per_token_head"))


@hookimpl
def kvcore_kernel_requirements(backend: Any, spec: Any) -> KernelRequirements | None:
    return REQUIREMENTS if _owns(backend) else None
