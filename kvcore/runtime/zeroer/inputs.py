"""What the zeroer is given, checked (block ids, layer views or vLLM's arguments), and the
segment table of where every manager block of those views lives (docs/zeroer.md)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from kvcore._validate import positive_int
from kvcore.memory.layout import block_runs
from kvcore.runtime.attn_group import flatten_attention_groups

_PLAIN_INT = frozenset({int})  # NOTE: the fast path's one element type (bool is no int here)
MAX_SEGMENTS = 1 << 20  # NOTE: views that would explode into more segments are refused


def _refuse(value: Any, num_blocks: int, why: str = "is not an integer") -> ValueError:
    return ValueError(f"block id {value!r} {why} in [0, {num_blocks}); pass manager block ids (ints) "
                      "from the block pool (nothing was zeroed)")


def _one_id(value: Any, num_blocks: int) -> int:
    """One element of an id list as an ``int`` (range checked by the caller)."""
    if isinstance(value, torch.Tensor):
        if value.dim() or value.device.type != "cpu" or not _integer_dtype(value.dtype):
            raise _refuse(value, num_blocks, "is not a 0-d integer CPU tensor (pass one id tensor instead)")
        return int(value)
    kind = getattr(getattr(value, "dtype", None), "kind", "i")
    if isinstance(value, bool) or kind not in "iu":
        raise _refuse(value, num_blocks)
    try:
        return operator.index(value)
    except TypeError:
        raise _refuse(value, num_blocks) from None


def _integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def id_list(values: list | tuple, num_blocks: int) -> list[int]:
    """A list or tuple of ids as a list of ints in ``[0, num_blocks)`` (plain ints checked in bulk)."""
    if _PLAIN_INT.issuperset(map(type, values)):
        ints = values if isinstance(values, list) else list(values)
    else:
        ints = [_one_id(v, num_blocks) for v in values]
    if ints and (min(ints) < 0 or max(ints) >= num_blocks):
        raise _refuse(next(v for v in ints if not 0 <= v < num_blocks), num_blocks, "is not")
    return ints


def host_ids(block_ids: Any, num_blocks: int) -> list[int] | torch.Tensor:
    """Any host form of ids as a checked list of ints or a flat CPU int64 tensor."""
    if isinstance(block_ids, Mapping):
        raise TypeError(f"block ids must be integers or a sequence of them, got a {type(block_ids).__name__}; "
                        "pass list(mapping.values()) (or its keys) if those are the manager block ids")
    if isinstance(block_ids, torch.Tensor) or getattr(block_ids, "ndim", 0):
        return tensor_ids(torch.as_tensor(block_ids), num_blocks, True)  # NOTE: or a NumPy array (ndim >= 1)
    if isinstance(block_ids, (str, bytes)) or hasattr(block_ids, "__index__") or not hasattr(block_ids, "__iter__"):
        return id_list([block_ids], num_blocks)  # NOTE: one id (or one thing that is none)
    return id_list(block_ids if isinstance(block_ids, (list, tuple)) else list(block_ids), num_blocks)


def tensor_ids(ids: torch.Tensor, num_blocks: int, check: bool) -> torch.Tensor:
    """An integer tensor of ids as a flat contiguous int32/int64 tensor; ``check``: range checked (a sync on GPUs)."""
    if not _integer_dtype(ids.dtype):
        raise ValueError(f"block id tensor has dtype {ids.dtype}, not an integer dtype; pass int32/int64 ids "
                         "(nothing was zeroed)")
    flat = ids.reshape(-1)
    flat = (flat if flat.dtype in (torch.int32, torch.int64) else flat.to(torch.int64)).contiguous()
    if check and flat.numel():
        for bound in (int(flat.min()), int(flat.max())):
            if not 0 <= bound < num_blocks:
                raise _refuse(bound, num_blocks, "is not")
    return flat


def views_of_groups(attn_groups: Iterable[Any], kernel_block_sizes: list[int | None],
                    kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
                    runner_only_attn_layers: Iterable[str] | None = None) -> dict[str, tuple[torch.Tensor, int]]:
    """The views of ``attn_groups``' layers (packed kernel-block views mapped back to manager blocks),
    but runner-only ones, missing ones and specs without layer views."""
    skip = set(runner_only_attn_layers or ())
    views: dict[str, tuple[torch.Tensor, int]] = {}
    for group in flatten_attention_groups(attn_groups):
        if not group.kv_cache_spec.has_layer_views:
            continue
        block_size, kernel = group.kv_cache_spec.block_size, group.kernel_block_size
        if kernel is None and group.kv_cache_group_id < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group.kv_cache_group_id]
        kernel = block_size if kernel is None else positive_int("kernel block size", kernel)
        if block_size % kernel:
            raise ValueError(f"group {group.kv_cache_group_id}: block size {block_size} is not divisible by kernel "
                             f"block size {kernel}; pass kernel_block_sizes that divide the block sizes")
        ratio = block_size // kernel
        for name in group.layer_names:
            view = kv_caches.get(name)
            if name in skip or not isinstance(view, torch.Tensor):
                continue
            if group.kernel_block_stride:  # NOTE: a packed kernel-block view
                views[name] = (group.map_kv_cache_to_manager_blocks(view, num_blocks), 1)
            elif view.shape[0] in (num_blocks, num_blocks * ratio) or (ratio == 1 and view.shape[0] > num_blocks):
                views[name] = (view, ratio if view.shape[0] == num_blocks * ratio else 1)
            else:
                raise ValueError(f"layer {name!r} has {view.shape[0]} rows, neither {num_blocks} manager blocks nor "
                                 f"{num_blocks * ratio} kernel blocks; pass the num_blocks and kernel_block_sizes "
                                 "the caches were allocated with")
    return views


def checked_views(views: Any, num_blocks: int) -> dict[str, tuple[torch.Tensor, int]]:
    """The ``views`` of ``KVBlockZeroer.from_views`` (layer -> ``(view, rows_per_block)``), checked."""
    if not isinstance(views, Mapping):
        raise TypeError(f"views must map layer names to (view, rows_per_block), got {type(views).__name__}")
    out = {}
    for name, entry in views.items():
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[0], torch.Tensor):
            raise TypeError(f"views[{name!r}] must be a (tensor view, rows_per_block) pair, got {type(entry).__name__}")
        view, rows = entry[0], positive_int(f"rows_per_block of layer {name!r}", entry[1])
        if view.dim() < 2:
            raise ValueError(f"layer {name!r}: a {view.dim()}-D tensor is no layer view [blocks, ...]; pass the views "
                             "allocate_kv_cache makes (raw buffers cannot be zeroed by block)")
        if view.shape[0] != num_blocks * rows:
            raise ValueError(f"layer {name!r} has {view.shape[0]} rows, not num_blocks * rows_per_block = "
                             f"{num_blocks} * {rows}; pass the views as allocated with their split ratio")
        out[name] = (view, rows)
    return out


@attrs.frozen(order=True)
class Segment:
    """Bytes ``[offset + b * block_stride, offset + b * block_stride + page)`` of block ``b``."""

    block_stride: int
    offset: int
    page: int


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Union of ``segments``: runs of one block stride that touch or overlap merge."""
    merged: list[Segment] = []
    for seg in sorted(set(segments)):  # NOTE: by block stride, then offset
        last = merged[-1] if merged else None
        if last is not None and last.block_stride == seg.block_stride and seg.offset <= last.offset + last.page:
            merged[-1] = attrs.evolve(last, page=max(last.page, seg.offset + seg.page - last.offset))
        else:
            merged.append(seg)
    return merged


class Allocation:
    """One allocation's merged segments, as bytes, as int32 vectors and as the kernel's chunk tables: per chunk
    size an int64 ``[3, chunks]`` table (start, block stride, length, in ``vec_bytes`` vectors), runs cut in chunks."""

    def __init__(self, storage: torch.UntypedStorage, segments: list[Segment], device: torch.device,
                 chunk_sizes: tuple[int, ...]) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        self.base = self.bytes[: storage.nbytes() // 4 * 4].view(torch.int32)
        self.segments = segments
        values = [storage.data_ptr()] + [v for s in segments for v in (s.offset, s.block_stride, s.page)]
        self.vec_bytes = next(width for width in (16, 8, 4) if all(v % width == 0 for v in values))
        self.tables = []
        for size in chunk_sizes:
            chunks = [(s.offset + begin, s.block_stride, min(size, s.page - begin))
                      for s in segments for begin in range(0, s.page, size)]
            columns = [[c[k] // self.vec_bytes for c in chunks] for k in range(3)]
            self.tables.append(torch.tensor(columns, dtype=torch.int64, device=device).reshape(3, len(chunks)))


def allocations(views: Mapping[str, tuple[torch.Tensor, int]], num_blocks: int, device: torch.device,
                chunk_sizes: tuple[int, ...]) -> list[Allocation]:
    """The allocations under ``views`` (layer -> ``(view, rows per block)``); ``ValueError`` unless every run is
    4-byte aligned and ``num_blocks`` blocks fit the allocation."""
    found: dict[int, tuple[torch.UntypedStorage, list[Segment]]] = {}
    for name, (view, rows) in views.items():
        if view.device != device:
            raise ValueError(f"layer {name!r} lives on {view.device}, the zeroer on {device}; "
                             "build the zeroer on the caches' device")
        storage, size = view.untyped_storage(), view.element_size()
        strides = [s * size for s in view.stride()]
        offsets, run = block_runs(view.shape, strides, size, rows, max_runs=MAX_SEGMENTS)
        start = view.data_ptr() - storage.data_ptr()
        found.setdefault(storage.data_ptr(), (storage, []))[1].extend(
            Segment(strides[0] * rows, start + o, run) for o in offsets)
    out = []
    for storage, segments in found.values():
        segments = merge_segments(segments)
        for seg in segments:
            if seg.offset % 4 or seg.block_stride % 4 or seg.page % 4:
                raise ValueError(f"KVBlockZeroer: a block run at byte {seg.offset} with block stride "
                                 f"{seg.block_stride} and {seg.page} bytes is not a multiple of 4 bytes; "
                                 "the zeroer stores 4-byte words, so pad pages and state sizes to 4 bytes")
            end = seg.offset + (num_blocks - 1) * seg.block_stride + seg.page
            if seg.offset < 0 or end > storage.nbytes():
                raise ValueError(f"KVBlockZeroer: block {num_blocks - 1} would end at byte {end}, beyond the "
                                 f"{storage.nbytes()}-byte allocation; pass the num_blocks the caches were planned for")
        out.append(Allocation(storage, segments, device, chunk_sizes))
    return out
