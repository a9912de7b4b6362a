"""Causal paged attention over varlen batches, in plain PyTorch, with no device sync.

Prefill chunks and decode tokens share one batch: request ``i`` owns query
rows ``query_start_loc[i]:query_start_loc[i + 1]``, which are the last tokens
of its ``seq_lens[i]``-token sequence. Its keys and values are gathered page
by page through ``block_table[i]`` (kernel block ids), so any block size and
any layout work; math runs in float32.

Requests are attended in chunks, queries padded to a chunk's longest. With
the value checks off (GPUs by default) chunk shapes come only from the
host-known ``max_query_len``/``max_seq_len``, so no step reads a tensor value
on the host and the computation can be captured in a CUDA graph. With them on
(CPU tensors, ``KVCORE_DEBUG_CHECKS=1``), the lengths are on the host anyway:
requests are then grouped by query length, so decode rows are not padded to
a prefill's length. See :func:`kvcore.plugins.paged_inputs.value_checks`.
"""

from __future__ import annotations

import torch

from kvcore.plugins.backend import KVQuantState
from kvcore.plugins.paged_inputs import (
    check_batch,
    check_batch_shapes,
    check_block_ids,
    check_cache_view,
    check_heads_and_window,
    check_tokens,
    value_checks,
)
from kvcore_torch.quant import dequantize

#: Float32 elements of scores and pages one request chunk may hold (256 MiB).
CHUNK_ELEMENTS = 1 << 26


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
    validate: bool | None = None,
    kv_quant: KVQuantState | None = None,
) -> torch.Tensor:
    """Attention of each new token over its request's cached tokens.

    :param query: ``[T, Hq, head_size]``; ``Hq`` a multiple of the cache's
        ``H`` KV heads (query head ``j`` reads KV head ``j // (Hq // H)``).
    :param kv_cache_view: kernel-block view ``[B, H, N, C]`` in any layout.
    :param block_table: ``[num_reqs, width]`` kernel block ids.
    :param query_start_loc: ``[num_reqs + 1]`` offsets of each request's rows.
    :param seq_lens: ``[num_reqs]`` tokens per request, new ones included.
    :param sliding_window: a token at position ``p`` sees keys at positions
        ``p - sliding_window < k <= p``; None for full causal attention.
    :param head_size_v: V elements per head; None means ``C - head_size``.
    :param max_query_len: / ``max_seq_len``: upper bounds of the batch's
        query and sequence lengths (the metadata's); None reads them from the
        tensors (one device sync).
    :param validate: check offsets, lengths and block ids on the host
        (``ValueError``). None: on for CPU tensors or under
        ``KVCORE_DEBUG_CHECKS=1``; off on GPUs, where block ids are clamped
        into the cache instead (never read out of bounds).
    :param kv_quant: the layer's quantization (``metadata.kv_quant``): pages are read back
        through their scales (:func:`kvcore_torch.quant.dequantize`); the query may then be
        any float dtype.
    :returns: ``[T, Hq, head_size_v]`` in ``query``'s dtype (``out`` if given).
    :raises TypeError: a query whose dtype is not the cache's (cast it first, as
        the Triton backend also asks).
    """
    head_size_v = check_cache_view(kv_cache_view, head_size, head_size_v, kv_quant=kv_quant)
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.shape[-1] != head_size:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [tokens, query heads, {head_size}], got {got}")
    num_tokens, num_q_heads, _ = query.shape
    # NOTE: one rule with the Triton backend: the query has the cache's dtype and device.
    check_tokens("query", query, num_tokens, num_q_heads, head_size, kv_cache_view, kv_quant is not None)
    num_blocks, num_kv_heads, block_size, _ = kv_cache_view.shape
    check_heads_and_window(num_q_heads, num_kv_heads, sliding_window)
    num_reqs = check_batch_shapes(query_start_loc, seq_lens, block_table)
    host = None
    if value_checks(validate, kv_cache_view.device):
        host = check_batch(query_start_loc, seq_lens, block_table, num_tokens)
        check_block_ids(block_table, host[1], block_size, num_blocks)
    if out is None:
        out = query.new_empty(num_tokens, num_q_heads, head_size_v)
    elif tuple(out.shape) != (num_tokens, num_q_heads, head_size_v):
        raise ValueError(f"out must have shape {(num_tokens, num_q_heads, head_size_v)}, got {tuple(out.shape)}")
    if num_tokens == 0 or num_reqs == 0:
        return out
    if host is not None:
        chunks = _chunks_by_length(
            *host, block_size, block_table.shape[1], num_q_heads, num_kv_heads, kv_cache_view.shape[-1]
        )
    else:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        chunks = _even_chunks(num_reqs, max_query_len, max_seq_len, block_size, block_table.shape[1],
                              num_q_heads, num_kv_heads, kv_cache_view.shape[-1])
    device = kv_cache_view.device
    starts = query_start_loc.to(device=device, dtype=torch.int64)
    lens = seq_lens.to(device=device, dtype=torch.int64)
    tokens = torch.arange(num_tokens, device=device)
    # Request of every query row (rows past query_start_loc[-1] belong to none and stay untouched).
    request = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=num_reqs)
    for members, width, cols in chunks:
        if isinstance(members, range):  # NOTE: made on the device: no host-to-device copy
            reqs = torch.arange(members.start, members.stop, device=device)
        else:
            reqs = torch.tensor(members, device=device)
        rows = _attend_requests(
            query, kv_cache_view, block_table, starts, lens, reqs, cols, width,
            head_size, head_size_v, scale, sliding_window, kv_quant,
        )  # [R, width, Hq, Dv]
        # Position of each request in this chunk (-1: not in it; index num_reqs: no request).
        place = torch.full((num_reqs + 1,), -1, dtype=torch.int64, device=device)
        place[reqs] = torch.arange(reqs.numel(), device=device)
        slot = place[request]
        row = tokens - starts[request.clamp(max=num_reqs - 1)]
        mine = (slot >= 0) & (row < width)
        picked = rows[slot.clamp(min=0), row.clamp(0, width - 1)]
        out.copy_(torch.where(mine[:, None, None], picked.to(out.dtype), out))
    return out


def _cost(num_q_heads: int, num_kv_heads: int, content: int, width: int, context: int) -> int:
    """Float32 elements one request holds in a chunk: scores and its gathered pages."""
    return num_q_heads * width * context + num_kv_heads * context * content


def _even_chunks(num_reqs, max_query_len, max_seq_len, block_size, table_cols, num_q_heads, num_kv_heads, content):
    """Chunks of consecutive requests, all padded to the batch's bounds (no length read on the host)."""
    if max_query_len <= 0 or max_seq_len <= 0:
        return []
    cols = min(table_cols, -(-max_seq_len // block_size))
    per_request = _cost(num_q_heads, num_kv_heads, content, max_query_len, cols * block_size)
    step = max(1, CHUNK_ELEMENTS // per_request)
    return [
        (range(first, min(num_reqs, first + step)), max_query_len, cols) for first in range(0, num_reqs, step)
    ]


def _chunks_by_length(starts, lens, block_size, table_cols, num_q_heads, num_kv_heads, content):
    """With host lengths: requests sorted by query length, each chunk padded to its own longest."""
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    order = sorted((i for i, q in enumerate(q_lens) if q > 0), key=lambda i: (q_lens[i], lens[i]))
    chunks, members, width, longest = [], [], 0, 0
    for i in order:
        w, n = max(width, q_lens[i]), max(longest, lens[i])
        cols = min(table_cols, -(-n // block_size))
        cost = _cost(num_q_heads, num_kv_heads, content, w, cols * block_size)
        if members and (len(members) + 1) * cost > CHUNK_ELEMENTS:
            chunks.append((members, width, min(table_cols, -(-longest // block_size))))
            members, w, n = [], q_lens[i], lens[i]
        members.append(i)
        width, longest = w, n
    if members:
        chunks.append((members, width, min(table_cols, -(-longest // block_size))))
    return chunks


def _attend_requests(query, view, block_table, starts, lens, reqs, cols, width,
                     head_size, head_size_v, scale, sliding_window, kv_quant=None) -> torch.Tensor:
    """Padded attention of requests ``reqs``: ``[R, width, Hq, head_size_v]`` in float32."""
    device = view.device
    num_reqs = reqs.numel()
    num_tokens, num_q_heads, _ = query.shape
    num_blocks, num_kv_heads, block_size, content = view.shape
    group = num_q_heads // num_kv_heads
    ids = block_table.to(device)[reqs, :cols].to(torch.int64).clamp(0, num_blocks - 1)
    # [R, cols, H, N, C] -> [R, H, cols * N, C]
    pages = view[ids].permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, cols * block_size, content).float()
    keys, values = pages[..., :head_size], pages[..., head_size : head_size + head_size_v]
    if kv_quant is not None:
        keys, values = _dequantized(kv_quant, ids, keys, values)
    keys, values = keys.unsqueeze(2), values.unsqueeze(2)  # [R, H, 1, S, D]
    offset = torch.arange(width, device=device)
    first, seq = starts[reqs], lens[reqs]
    q_lens = starts[reqs + 1] - first
    token = (first[:, None] + offset).clamp(0, num_tokens - 1)  # [R, W]
    q = query.to(device)[token].float()  # [R, W, Hq, D]
    q = q.view(num_reqs, width, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # [R, H, G, W, D]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [R, H, G, W, S]
    q_pos = (seq - q_lens)[:, None] + offset  # [R, W]
    k_pos = torch.arange(cols * block_size, device=device)
    visible = (k_pos <= q_pos[..., None]) & (k_pos < seq[:, None, None])  # [R, W, S]
    if sliding_window is not None:
        visible &= q_pos[..., None] - k_pos < sliding_window
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    # NOTE: keys no query of a request sees (padding, out of the window) are often the null
    # block's bytes, which may hold NaN: 0 x NaN is NaN, so they are masked, not multiplied.
    values = values.masked_fill(~visible.any(dim=1)[:, None, None, :, None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    result = torch.matmul(probs, values)  # [R, H, G, W, Dv]
    return result.permute(0, 3, 1, 2, 4).reshape(num_reqs, width, num_q_heads, head_size_v)


def _dequantized(kv_quant: KVQuantState, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """Gathered pages ``[R, H, S, D]`` read back through the layer's scales."""
    if kv_quant.kv_quant == "per_tensor":
        return dequantize(keys, kv_quant.k_scale), dequantize(values, kv_quant.v_scale)
    num_reqs, num_kv_heads, tokens, _ = keys.shape
    scales = kv_quant.scale_cache[ids].permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, tokens, 2)
    return dequantize(keys, scales[..., 0]), dequantize(values, scales[..., 1])
