"""Host-side checks of paged-attention inputs, shared by backends: shapes, dtypes and devices
always; tensor values (a device sync) only where :func:`value_checks` says (README: Backends)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from kvcore.plugins.backend import KVQuantState
from kvcore.settings import Settings

DEBUG_CHECKS_ENV = "KVCORE_DEBUG_CHECKS"


def value_checks(validate: bool | None, device: torch.device, settings: Settings | None = None) -> bool:
    """Whether checks that read tensor values run: ``validate``, else ``settings`` (or the env)."""
    if validate is not None:
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be True, False or None, got {validate!r}")
        return validate
    return step_checks((settings or Settings.from_env()).debug_checks, device)


def step_checks(debug_checks: bool | None, device: torch.device) -> bool:
    return device.type == "cpu" if debug_checks is None else debug_checks


def write_then_attend(write_kv: Callable[..., None], paged_attention: Callable[..., torch.Tensor], query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor, kv_cache_view: torch.Tensor, metadata: Any, *,
                      head_size: int, scale: float, sliding_window: int | None = None, out: torch.Tensor | None = None,
                      **kernel_options: Any) -> torch.Tensor:
    """The ``forward`` of a backend made of two kernels: ``write_kv``, then ``paged_attention``.

    Rows past ``num_actual_tokens`` are padding; value checks follow ``metadata.debug_checks``
    only (this runs per layer: never the environment, no device sync on GPUs by default).
    """
    n = metadata.num_actual_tokens
    validate = step_checks(metadata.debug_checks, kv_cache_view.device)
    quant = getattr(metadata, "kv_quant", None)
    if quant is not None:  # NOTE: a quantized layer: both kernels take its scales
        kernel_options["kv_quant"] = quant
    write_kv(kv_cache_view, key[:n], value[:n], metadata.slot_mapping[:n], head_size, validate=validate,
             **({} if quant is None else {"kv_quant": quant}))
    return paged_attention(query[:n], kv_cache_view, metadata.block_table_tensor, metadata.query_start_loc,
                           metadata.seq_lens, head_size=head_size, scale=scale, sliding_window=sliding_window,
                           head_size_v=value.shape[-1], out=None if out is None else out[:n],
                           max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len, validate=validate,
                           **kernel_options)


def _got(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def check_kv_quant(kv_cache_view: torch.Tensor, kv_quant: Any) -> None:
    """``kv_quant`` must be the :class:`KVQuantState` of ``kv_cache_view`` (dtype, scale view)."""
    if not isinstance(kv_quant, KVQuantState) or kv_quant.dtype != kv_cache_view.dtype:
        raise TypeError(f"kv_quant must be the KVQuantState (metadata.kv_quant) of a {kv_cache_view.dtype} view, "
                        f"got {kv_quant!r:.120}")
    want, scales = (*kv_cache_view.shape[:3], 2), kv_quant.scale_cache
    if kv_quant.kv_quant == "per_token_head" and not (
        isinstance(scales, torch.Tensor) and scales.dtype == torch.float32 and tuple(scales.shape) == want
    ):
        raise ValueError(f"kv_quant.scale_cache must be a float32 {want} view, got {_got(scales)}")
    if kv_quant.kv_quant == "per_token_head":
        _on_device_of("kv_quant.scale_cache", scales, kv_cache_view)


def check_cache_view(kv_cache_view: torch.Tensor, head_size: int, head_size_v: int | None,
                     dtypes: Collection[torch.dtype] | None = None, kv_quant: KVQuantState | None = None) -> int:
    """Validate a kernel-block view ``[B, H, N, C]`` (and its ``kv_quant``); return ``head_size_v``."""
    if not isinstance(kv_cache_view, torch.Tensor) or kv_cache_view.dim() != 4:
        raise TypeError(
            "kv_cache_view must be a 4-D [blocks, heads, block_size, content] tensor, got "
            + _got(kv_cache_view)
        )
    view_dtype = kv_cache_view.dtype
    if kv_quant is not None:
        check_kv_quant(kv_cache_view, kv_quant)
    elif not (kv_cache_view.is_floating_point() if dtypes is None else view_dtype in dtypes):
        wanted = "a floating dtype" if dtypes is None else str([str(d) for d in dtypes])
        raise TypeError(f"kv_cache_view has dtype {view_dtype}, this backend takes {wanted}; "
                        "re-type the layer's view to the spec's dtype (allocate_kv_cache does this)")
    content = kv_cache_view.shape[-1]
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    if head_size_v is None:
        head_size_v = content - head_size
    if head_size_v <= 0 or head_size + head_size_v > content:
        raise ValueError(f"head_size={head_size} and head_size_v={head_size_v} do not fit the {content} "
                         "content elements of kv_cache_view; K is view[..., :head_size] and V follows it")
    return head_size_v


def check_tokens(name: str, tensor: torch.Tensor, tokens: int, heads: int, size: int, like: torch.Tensor,
                 quantized: bool = False) -> None:
    """``tensor`` must be ``[tokens, heads, size]`` with ``like``'s dtype (``quantized``: any
    floating dtype) and device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != (tokens, heads, size):
        raise ValueError(f"{name} must have shape {(tokens, heads, size)}, got {tuple(tensor.shape)}")
    if quantized and not tensor.is_floating_point():
        raise TypeError(f"{name} has dtype {tensor.dtype}; a quantized KV cache takes floating values")
    if tensor.dtype != like.dtype and not quantized:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the KV cache holds {like.dtype}; cast it first")
    _on_device_of(name, tensor, like)


def _on_device_of(name: str, tensor: torch.Tensor, like: torch.Tensor | None) -> None:
    if like is not None and tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but the KV cache is on {like.device}; move it")


def check_index(name: str, tensor: torch.Tensor, dim: int, like: torch.Tensor | None = None) -> None:
    """``tensor`` must be an int32/int64 tensor of ``dim`` dims (on ``like``'s device)."""
    is_index = isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.int32, torch.int64)
    if not is_index or tensor.dim() != dim:
        raise TypeError(f"{name} must be a {dim}-D int32 or int64 tensor, got {_got(tensor)}")
    _on_device_of(name, tensor, like)


def check_kv_write(kv_cache_view: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                   head_size: int, dtypes: Collection[torch.dtype] | None = None, *, check_slots: bool = True,
                   kv_quant: KVQuantState | None = None) -> int:
    """Validate a write of ``key``/``value`` through ``slot_mapping``; return the view's slots.

    ``check_slots``: every slot must be below ``B * N`` (a device sync on GPUs); negative: padding.
    """
    head_size_v = value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() == 3 else None
    head_size_v = check_cache_view(kv_cache_view, head_size, head_size_v, dtypes, kv_quant)
    check_index("slot_mapping", slot_mapping, 1, kv_cache_view)
    num_tokens = slot_mapping.shape[0]
    num_blocks, num_heads, block_size, _ = kv_cache_view.shape
    quantized = kv_quant is not None
    check_tokens("key", key, num_tokens, num_heads, head_size, kv_cache_view, quantized)
    check_tokens("value", value, num_tokens, num_heads, head_size_v, kv_cache_view, quantized)
    num_slots = num_blocks * block_size
    if check_slots and num_tokens and (top := int(slot_mapping.max())) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {top} but the cache has {num_slots} slots "
                         f"({num_blocks} blocks of {block_size}); map block ids to kernel blocks first")
    return num_slots


def check_heads_and_window(num_q_heads: int, num_kv_heads: int, sliding_window: int | None) -> None:
    """Query heads must share the KV heads evenly (GQA); a window must be a positive int."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot share {num_kv_heads} KV heads "
                         "evenly; the query head count must be a multiple of the KV head count")
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")


def check_batch(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
) -> tuple[list[int], list[int]]:
    """Validate a varlen batch's shapes and values (a value check); its starts and lengths."""
    check_batch_shapes(query_start_loc, seq_lens, block_table)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to the {num_tokens} "
                         f"query tokens, got {starts[0]}..{starts[-1]}")
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"request {i} has {q_len} new tokens but seq_len {seq_len}; query_start_loc "
                             "must be non-decreasing and seq_lens must count the new tokens too")
    return starts, lens


def check_batch_shapes(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       like: torch.Tensor | None = None) -> int:
    """Index dtypes, dims and lengths of a varlen batch (no sync); return the request count."""
    check_index("block_table", block_table, 2, like)
    check_index("query_start_loc", query_start_loc, 1, like)
    check_index("seq_lens", seq_lens, 1, like)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] < num_reqs:
        raise ValueError(f"{num_reqs} requests need query_start_loc of length {num_reqs + 1} and a block table of "
                         f"at least {num_reqs} rows, got {query_start_loc.shape[0]} and {block_table.shape[0]}")
    return num_reqs


def check_block_ids(block_table: torch.Tensor, seq_lens: list[int], block_size: int, num_blocks: int) -> None:
    """Every block a request reads must exist: a value check (reads the table)."""
    needed = max((-(-n // block_size) for n in seq_lens), default=0)
    if needed > block_table.shape[1]:
        raise ValueError(f"a sequence of {max(seq_lens)} tokens needs {needed} blocks of "
                         f"{block_size}, but the block table has {block_table.shape[1]} columns")
    for i, seq_len in enumerate(seq_lens):
        ids = block_table[i, : -(-seq_len // block_size)]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"request {i} reads block ids {ids.tolist()} but the cache has {num_blocks} "
                             "kernel blocks; map manager block tables to kernel blocks first")
