"""Per-layer strided views over the one backing allocation."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from kvcore._units import format_bytes
from kvcore._validate import positive_int
from kvcore.errors import KVCoreError
from kvcore.memory.config import KVCacheConfig, KVCacheTensor
from kvcore.memory.layout import KVCacheLayout, compute_layout_strides, kernel_extents, scale_unit, split_ratio
from kvcore.specs import KVCacheSpec

_BYTE_DTYPES = (torch.int8, torch.uint8)


def create_kv_cache_views(raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int, layout: KVCacheLayout | str,
                          kv_cache_tensor: KVCacheTensor, kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """One ``[B', H, N, C]`` view per layer of ``kv_cache_tensor`` over the int8 buffer ``raw``,
    re-typed to ``spec.view_dtype`` (splitting blocks into kernel blocks needs dense pages)."""
    return _views(raw, spec, num_blocks, layout, kv_cache_tensor, kernel_block_size, False)


def create_scale_views(raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int, layout: KVCacheLayout | str,
                       kv_cache_tensor: KVCacheTensor, kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """One float32 ``[B', H, N, 2]`` view (K scale, V scale) per layer of a per-token-head spec,
    addressed like its data view: the bytes after the data rows of each :func:`scale_unit`."""
    if not spec.scale_size_bytes:
        return []
    return _views(raw, spec, num_blocks, layout, kv_cache_tensor, kernel_block_size, True)


def _views(raw, spec, num_blocks, layout, tensor, kernel_block_size, scales: bool) -> list[torch.Tensor]:
    if not isinstance(raw, torch.Tensor) or raw.dtype not in _BYTE_DTYPES or raw.dim() != 1:
        got = f" {raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else ""
        raise TypeError(f"raw must be a 1-D int8 tensor (the backing allocation), got {type(raw).__name__}{got}")
    layout = KVCacheLayout.parse(layout)
    if not isinstance(tensor, KVCacheTensor):
        raise TypeError(f"kv_cache_tensor must be a KVCacheTensor, got {tensor!r}")
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {spec!r}")
    ratio = split_ratio(spec.block_size, kernel_block_size)
    if ratio > 1 and tensor.block_stride != spec.real_page_size_bytes:
        padded = spec.page_size_padded
        unpadded = "" if padded is None else f" with an unpadded spec (not padded to {padded})"
        raise ValueError(f"layout {layout.name} does not store the blocks of {list(tensor.layers)} as dense "
                         f"pages (block stride {tensor.block_stride} bytes, page {spec.real_page_size_bytes} "
                         f"bytes), so {spec.block_size}-token blocks cannot be split into "
                         f"{kernel_block_size}-token kernel blocks; use a smaller manager block size "
                         f"({kernel_block_size} tokens) or a layer-compact layout such as LBNHC{unpadded}")
    # NOTE: a one-layer tensor's layer stride addresses nothing; leaving it
    # free keeps dims outside L (H in BHLNC) at kernel-block granularity.
    layer_stride = tensor.layer_stride if len(tensor.layers) > 1 else None
    fixed = (layer_stride, tensor.block_stride // ratio, None, None, None)
    num_layers = len(tensor.layers)
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout, kernel_block_size, fixed)
    shape = kernel_extents(spec, num_blocks, num_layers, kernel_block_size)[1:]
    view_strides, dtype, offset = strides[1:], spec.view_dtype, tensor.offset
    if scales:  # NOTE: a unit's scale pairs mirror its data rows, 8 bytes for C bytes
        unit, size = scale_unit(layout), spec.scale_size_bytes
        offset += math.prod(shape[d - 1] for d in unit)
        view_strides = (*(s // shape[-1] * size if d in unit else s for d, s in enumerate(strides[1:4], 1)), 1)
        shape, dtype = (*shape[:3], size), torch.float32
    span = 1 + sum((n - 1) * s for n, s in zip(shape, view_strides))
    base = raw.storage_offset() + offset
    if any(s % dtype.itemsize for s in (*view_strides[:3], base, tensor.layer_stride)):
        raise ValueError(f"strides {strides} / start byte {base} of {list(tensor.layers)} are not multiples of the "
                         f"{dtype.itemsize}-byte {dtype}; align the tensor's strides, offset and page padding to it")
    end = min(raw.numel(), tensor.size)
    views = []
    for index, name in enumerate(tensor.layers):
        start = offset + index * tensor.layer_stride
        if start + span > end:
            raise ValueError(f"layer {name!r} spans bytes [{start}, {start + span}) but the "
                             f"buffer holds {end}; plan fewer blocks or a larger tensor")
        views.append(raw.as_strided(shape, view_strides, raw.storage_offset() + start).view(dtype))
    return views


def to_kernel_blocks(view: torch.Tensor, kernel_rows: int, stride: int) -> torch.Tensor:
    """A manager-block view ``[B, H, N, C]`` as ``[pages, H, kernel_rows, C]`` kernel pages, kernel
    page ``j`` of block ``b`` being page ``b * stride + j`` (other layers' pages between blocks)."""
    num_pages = (view.shape[0] - 1) * stride + view.shape[-2] // kernel_rows
    return view.as_strided((num_pages, *view.shape[1:-2], kernel_rows, view.shape[-1]),
                           (kernel_rows * view.stride(-2), *view.stride()[1:]))


def with_kernel_pages(kv_caches: Mapping[str, torch.Tensor], pages: Mapping[str, tuple[int, int]]) -> dict:
    """``kv_caches`` with each layer of ``pages`` (layer -> kernel rows, stride) addressed by
    kernel pages (:func:`to_kernel_blocks`)."""
    return {name: to_kernel_blocks(view, *pages[name]) if name in pages else view for name, view in kv_caches.items()}


def to_manager_blocks(view: torch.Tensor, rows: int, stride: int, num_blocks: int) -> torch.Tensor:
    """The inverse of :func:`to_kernel_blocks`."""
    return view.as_strided((num_blocks, *view.shape[1:-2], rows, view.shape[-1]),
                           (view.stride(0) * stride, *view.stride()[1:]))


def checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device this process can allocate on, else KVCoreError."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        remedy = "pass 'cpu', 'cuda' or 'cuda:N'"
        raise KVCoreError(f"invalid device {device!r} ({exc}); {remedy}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KVCoreError(f"device {str(device)!r} was requested but this torch has no usable "
                              f"CUDA (torch {torch.__version__}, CUDA {torch.version.cuda}); pass "
                              "device='cpu' or install a CUDA build of torch on a machine with a GPU")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise KVCoreError(f"device {str(device)!r} does not exist: this machine has "
                              f"{count} CUDA device(s); pass one of cuda:0 .. cuda:{count - 1}")
    return device


def _zeroed_buffer(size: int, device: torch.device | str) -> torch.Tensor:
    device = checked_device(device)
    try:
        return torch.zeros(size, dtype=torch.int8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if device.type == "cuda":
            torch.cuda.empty_cache()
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise KVCoreError(f"cannot allocate the {format_bytes(size)} KV cache on {device} "
                          f"({type(exc).__name__}: {detail}); plan it with less memory (available_memory=... "
                          "or fewer num_blocks) or use a device with more free memory") from exc


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device: torch.device | str,
                      layout: KVCacheLayout | str | None = None, kernel_block_sizes: list[int | None] | None = None, *,
                      buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Allocate one zero-filled int8 buffer and view it per layer as ``[B, H, N, C]``;
    ``buffer`` is viewed instead (an elastic cache's reservation). A refusal allocates nothing."""
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
    if not kv_cache_config.kv_cache_tensors:
        return {}
    sizes = sorted({t.size for t in kv_cache_config.kv_cache_tensors})
    if len(sizes) != 1:
        raise ValueError("KV cache tensors must share one backing allocation, but their "
                         f"sizes differ: {sizes} bytes; give every tensor the same size")
    planned = kv_cache_config.layout
    layout = planned if layout is None else KVCacheLayout.parse(layout)
    if layout is not planned:
        raise ValueError(f"layout {layout.name} is not the layout the config was planned for ({planned.name}); pass "
                         f"layout=None or {planned.name!r}, or plan again with plan_kv_cache(..., {layout.name!r})")
    if kernel_block_sizes is not None:
        if isinstance(kernel_block_sizes, str) or not isinstance(kernel_block_sizes, Sequence):
            got = repr(kernel_block_sizes)
            raise TypeError(f"kernel_block_sizes must be a list of ints (one per group), got {got}")
        kernel_block_sizes = [
            None if k is None else positive_int(f"kernel_block_sizes[{i}]", k)
            for i, k in enumerate(kernel_block_sizes)
        ]
    size = sizes[0]
    # NOTE: views over a meta buffer first, so a refusal allocates nothing.
    meta = torch.empty(size, dtype=torch.int8, device="meta")
    _layer_views(kv_cache_config, meta, layout, kernel_block_sizes)
    if buffer is None:
        buffer = _zeroed_buffer(size, device)
    elif buffer.dtype not in _BYTE_DTYPES or buffer.dim() != 1 or buffer.numel() != size:
        got = f"{buffer.dtype} {tuple(buffer.shape)}"
        raise ValueError(f"buffer must be a 1-D int8 tensor of {size} bytes, got {got}")
    return _layer_views(kv_cache_config, buffer, layout, kernel_block_sizes)


def allocate_scale_views(config: KVCacheConfig, buffer: torch.Tensor, kernel_block_sizes: list | None = None) -> dict:
    """The scale views (:func:`create_scale_views`) of every per-token-head layer of ``config``
    allocated over ``buffer`` (flat int8), addressed like its data views."""
    return _layer_views(config, buffer, config.layout, kernel_block_sizes, create_scale_views)


def _layer_views(config: KVCacheConfig, buf: torch.Tensor, layout: KVCacheLayout, kernels: list | None,
                 make=create_kv_cache_views) -> dict[str, torch.Tensor]:
    kernels = kernels or []
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in config.kv_cache_tensors:
        group_id, group = config.group_of(tensor.layers[0])
        spec = group.spec_of(tensor.layers[0])
        if not spec.has_layer_views:
            if make is create_kv_cache_views:
                kv_caches.update((name, buf) for name in tensor.layers)
            continue
        kernel = kernels[group_id] if group_id < len(kernels) else None
        views = make(buf, spec, config.num_blocks_of(tensor), layout, tensor, kernel)
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches
