"""The launcher of the Triton paged-attention kernels.

Decode-only batches (every request has at most one new token) go to the
split-K decode kernel; anything else to the varlen kernel, which serves
prefill, chunked prefill and decode rows of a mixed batch in one launch.
"""

from __future__ import annotations

import functools

import attrs
import torch
import triton
import triton.language as tl

from kvcore.plugins.backend import KVQuantState

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # NOTE: an older Triton has no host-side TMA descriptors: every tile takes the pointer path
    TensorDescriptor = None

from kvcore_triton._checks import (
    check_batch,
    check_batch_shapes,
    check_block_ids,
    check_cache_view,
    check_heads_and_window,
    check_tokens,
    value_checks,
)
from kvcore_triton.decode import LOG2E, _decode_merge_kernel, _decode_split_kernel
from kvcore_triton.prefill import _varlen_kernel
from kvcore_triton.quant import dot_scale_factor, quant_args, widen_mode


def _positive(inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"KernelConfig.{attribute.name} must be a positive int, got {value!r}")


def _bool(inst, attribute, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"KernelConfig.{attribute.name} must be True or False, got {value!r}")


def _power_of_two_at_least_16(inst, attribute, value) -> None:
    _positive(inst, attribute, value)
    if value < 16 or value & (value - 1):
        raise ValueError(
            f"KernelConfig.{attribute.name} must be a power of two >= 16 (tl.dot tiles), got {value}"
        )


@attrs.frozen(kw_only=True)
class KernelConfig:
    """Launch knobs: tokens per tile, warps, pipeline stages, decode splits, the decode read path."""

    tile: int = attrs.field(default=64, validator=_power_of_two_at_least_16)
    #: Warps per program; None picks each kernel's measured default (decode 2, varlen 4).
    num_warps: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    num_stages: int = attrs.field(default=3, validator=_positive)
    #: None picks enough context splits to fill the device (decode only).
    num_splits: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    #: Query rows (tokens x heads of a GQA group) per varlen program.
    prefill_rows: int = attrs.field(default=64, validator=_power_of_two_at_least_16)
    min_split_tokens: int = attrs.field(default=256, validator=_positive)
    #: Decode reads K/V tiles with TMA copies where they apply: compute capability 9.0+ (or the
    #: interpreter), tile <= kernel block size, head == head_v a power of two >= 16, 16-byte aligned
    #: strides; such tiles mask only a split's edges and the grid runs a request's KV heads side by
    #: side. False (or anywhere TMA does not apply): the pointer path, a (request, KV head, split) grid.
    tma: bool = attrs.field(default=True, validator=_bool)
    #: Decode over an 8-bit cache on a GPU: widen each V tile to float16 as loaded (full-width loads,
    #: packed conversions) and hand it to the dot through a 16-bit shared-memory transpose, instead
    #: of loading the dot's operand byte by byte. No effect on other caches or under the interpreter.
    stage_v: bool = attrs.field(default=False, validator=_bool)


#: Decode over an 8-bit cache when the caller gives no config, where TMA reads the tiles: one warp per
#: program and six stages, V tiles converted in the dot's operand layout. A program holds 37 KB of
#: shared memory (two warps with V widened as loaded: 55 KB), so six run on each H200 SM instead of
#: four. bench_decode.py on the H200 measured it fastest for every 8-bit storage type.
QUANT_DECODE_TMA = KernelConfig(num_warps=1, num_stages=6)
#: ... and where the pointer path reads them (tiles spanning kernel blocks, no TMA): two warps, five
#: stages, V widened as loaded (one warp there ran up to 2.3x slower).
QUANT_DECODE_POINTER = KernelConfig(num_warps=2, num_stages=5, stage_v=True)

#: The decode read paths bench_decode.py times (KernelConfig overrides). Both are kept: each
#: measured fastest where it applies (H200, BENCHMARKS.md); the variants that never won are gone.
DECODE_VARIANTS: dict[str, dict] = {"base": {}, "pointer": {"tma": False}}


def _dot_dtype(query: torch.Tensor, cache_dtype: torch.dtype) -> tl.dtype:
    # NOTE: the Triton interpreter (CPU tensors) mis-computes bf16 tl.dot; upcast there.
    if query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and query.device.type == "cpu"):
        return tl.float32
    # NOTE: 8-bit values widen to float16 exactly in packed conversions (to bfloat16 fp8 takes a
    # second one); queries and probabilities (times an amax, per token and head) sit well inside
    # its range, and its 10 mantissa bits hold them more precisely than bfloat16's 7.
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        return tl.float16
    return tl.float16 if query.dtype == torch.float16 else tl.bfloat16


@functools.cache
def _sm_count(device: torch.device) -> int:
    # NOTE: cached: asking the driver on every call cost tens of microseconds of host time.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _num_splits(config: KernelConfig, programs: int, context: int, device: torch.device) -> int:
    if config.num_splits is not None:
        return max(1, min(config.num_splits, triton.cdiv(context, config.tile)))
    sms = _sm_count(device)
    # NOTE: aim for about two programs per SM; on an H200 a batch of 64 x 8 KV
    # heads (512 programs) decoded fastest unsplit (bench_decode.py --sweep).
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, triton.cdiv(context, config.min_split_tokens), 64))


#: Warps per program when ``KernelConfig.num_warps`` is None (bench_decode.py, H200: 2 warps
#: decoded the benchmark shape 0.1-0.9% faster than 4 in every run; the varlen kernel keeps 4).
DECODE_WARPS, VARLEN_WARPS = 2, 4


@functools.cache
def _has_tma(device: torch.device) -> bool:
    if device.type == "cpu":
        return True  # NOTE: the interpreter runs descriptor loads, so CPU tests cover this path
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _tma_fits(view: torch.Tensor, config: KernelConfig, head_size: int, head_size_v: int) -> bool:
    """Whether TMA copies of ``[1, 1, tile, head]`` boxes can read the cache view's decode tiles."""
    size = view.element_size()
    return (
        config.tma
        and TensorDescriptor is not None
        and _has_tma(view.device)
        and config.tile <= view.shape[2]
        and head_size == head_size_v == triton.next_power_of_2(head_size)
        and 16 <= head_size <= 256  # NOTE: a TMA box side is at most 256 elements
        and view.stride(-1) == 1
        and all(stride * size % 16 == 0 for stride in view.stride()[:-1])
        and view.data_ptr() % 16 == 0
    )


def _tma_descriptor(view: torch.Tensor, config: KernelConfig, head_size: int, head_size_v: int):
    """A descriptor of ``[1, 1, tile, head]`` boxes over the cache view, or None where TMA cannot read it."""
    if not _tma_fits(view, config, head_size, head_size_v):
        return None
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [1, 1, config.tile, head_size])


def quant_decode_config(view: torch.Tensor, head_size: int, head_size_v: int) -> KernelConfig:
    """The launch a decode over the 8-bit cache ``view`` gets without a config."""
    return QUANT_DECODE_TMA if _tma_fits(view, QUANT_DECODE_TMA, head_size, head_size_v) else QUANT_DECODE_POINTER


def paged_attention(
    query: torch.Tensor,
    kv_cache_view: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    head_size: int,
    scale: float,
    sliding_window: int | None = None,
    head_size_v: int | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    config: KernelConfig | None = None,
    validate: bool | None = None,
    kv_quant: KVQuantState | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its request's paged K/V.

    Arguments match ``kvcore_torch.paged_attention``: ``query`` is
    ``[T, Hq, head_size]`` in the cache's dtype, ``block_table`` holds kernel
    block ids (which must be valid: they are not checked on the device),
    request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]``,
    the last of its ``seq_lens[i]`` tokens. Pass ``max_query_len`` and
    ``max_seq_len`` to avoid a device sync. ``validate`` checks offsets,
    lengths and block ids on the host (``ValueError``); None: on for CPU
    tensors or under ``KVCORE_DEBUG_CHECKS=1``, off on GPUs (no sync).
    ``kv_quant`` (``metadata.kv_quant``) reads a quantized cache through its
    scales; the query is then in any float dtype. Returns ``[T, Hq, head_size_v]``.
    """
    head_size_v = check_cache_view(kv_cache_view, head_size, head_size_v, kv_quant)
    num_blocks, num_kv_heads, block_size, _ = kv_cache_view.shape
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be [tokens, query heads, {head_size}], got {getattr(query, 'shape', query)!r}")
    num_tokens, num_q_heads, _ = query.shape
    check_tokens("query", query, num_tokens, num_q_heads, head_size, kv_cache_view, kv_quant is not None)
    check_heads_and_window(num_q_heads, num_kv_heads, sliding_window)
    num_reqs = check_batch_shapes(query_start_loc, seq_lens, block_table, kv_cache_view)
    if value_checks(validate, kv_cache_view.device):
        _, lens = check_batch(query_start_loc, seq_lens, block_table, num_tokens)
        check_block_ids(block_table, lens, block_size, num_blocks)
    if out is None:
        out = query.new_empty(num_tokens, num_q_heads, head_size_v)
    elif tuple(out.shape) != (num_tokens, num_q_heads, head_size_v) or out.stride(-1) != 1:
        raise ValueError(f"out must be a {(num_tokens, num_q_heads, head_size_v)} tensor with unit last stride")
    if num_tokens == 0 or num_reqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    query = query if query.stride(-1) == 1 else query.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    group = num_q_heads // num_kv_heads
    quant = quant_args(kv_cache_view, kv_quant)
    if config is None:  # NOTE: a decode over an 8-bit cache has its own default; prefill keeps the plain one
        config = quant_decode_config(kv_cache_view, head_size, head_size_v) if quant.mode and max_query_len <= 1 \
            else KernelConfig()
    common = dict(
        HEAD=head_size, HEAD_V=head_size_v,
        D_PAD=max(16, triton.next_power_of_2(head_size)), DV_PAD=max(16, triton.next_power_of_2(head_size_v)),
        BLOCK_N=block_size, TILE=config.tile,
        DOT_DTYPE=_dot_dtype(query, kv_cache_view.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        QUANT=quant.mode, num_stages=config.num_stages,
    )
    strides = (
        query.stride(0), query.stride(1), *kv_cache_view.stride(),
        block_table.stride(0), out.stride(0), out.stride(1), *quant.strides,
    )
    qk_scale = scale * LOG2E * dot_scale_factor(quant)
    window = sliding_window or 0
    if max_query_len > 1:
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, config.prefill_rows // group_pad)
        grid = (num_reqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
        _varlen_kernel[grid](
            query, kv_cache_view, quant.scales, block_table, query_start_loc, seq_lens, out, qk_scale,
            quant.v_scale, window, *strides,
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, num_warps=config.num_warps or VARLEN_WARPS, **common,
        )
        return out
    group_pad = max(16, triton.next_power_of_2(group))
    # NOTE: tiles start at multiples of the tile, so a window's span may grow by tile - 1 tokens.
    context = min(max_seq_len, window + config.tile - 1) if window else max_seq_len
    splits = _num_splits(config, num_reqs * num_kv_heads, context, query.device)
    tokens_per_split = triton.cdiv(triton.cdiv(context, splits), config.tile) * config.tile
    splits = triton.cdiv(context, tokens_per_split)
    if splits > 1:
        partials = num_reqs * num_kv_heads * splits * group_pad
        part_ml = torch.empty(partials * 2, dtype=torch.float32, device=query.device)
        part_acc = torch.empty(partials * common["DV_PAD"], dtype=torch.float32, device=query.device)
    else:
        part_ml = part_acc = out  # NOTE: never touched by an unsplit launch (SINGLE); saves two allocations
    kv_desc = _tma_descriptor(kv_cache_view, config, head_size, head_size_v)
    tma = kv_desc is not None
    grid = (num_reqs * num_kv_heads * splits,) if tma else (num_reqs, num_kv_heads, splits)
    _decode_split_kernel[grid](
        # NOTE: the pointer path never reads kv_desc; the view stands in for it there.
        query, kv_cache_view, kv_desc if tma else kv_cache_view, quant.scales, block_table, query_start_loc,
        seq_lens, part_ml, part_acc, out,
        qk_scale, quant.v_scale, window, tokens_per_split, splits, num_kv_heads, block_table.shape[1] * block_size,
        *strides,
        GROUP=group, GROUP_PAD=group_pad, SINGLE=splits == 1, WINDOWED=window > 0, TMA=tma,
        WIDEN=widen_mode(kv_cache_view.dtype, common["DOT_DTYPE"]), STAGE_V=config.stage_v,
        num_warps=config.num_warps or DECODE_WARPS, **common,
    )
    if splits > 1:
        _decode_merge_kernel[(num_reqs, num_q_heads)](
            part_ml, part_acc, out, query_start_loc, splits, out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_V=head_size_v, DV_PAD=common["DV_PAD"],
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
