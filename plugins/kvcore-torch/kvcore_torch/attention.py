"""Causal paged attention over varlen batches, in plain PyTorch.

Prefill chunks and decode tokens share one batch: request ``i`` owns query
rows ``query_start_loc[i]:query_start_loc[i + 1]``, which are the last tokens
of its ``seq_lens[i]``-token sequence. Its keys and values are gathered page
by page through ``block_table[i]`` (kernel block ids), so any block size and
any layout work; math runs in float32.
"""

from __future__ import annotations

import torch

from kvcore_torch._checks import check_batch, check_cache_view, check_heads_and_window


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
    :returns: ``[T, Hq, head_size_v]`` in ``query``'s dtype (``out`` if given).
    """
    head_size_v = check_cache_view(kv_cache_view, head_size, head_size_v)
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.shape[-1] != head_size:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [tokens, query heads, {head_size}], got {got}")
    num_tokens, num_q_heads, _ = query.shape
    num_blocks, num_kv_heads, block_size, _ = kv_cache_view.shape
    check_heads_and_window(num_q_heads, num_kv_heads, sliding_window)
    starts, lens = check_batch(query_start_loc, seq_lens, block_table, num_tokens)
    needed = max((-(-n // block_size) for n in lens), default=0)
    if needed > block_table.shape[1]:
        raise ValueError(
            f"a sequence of {max(lens)} tokens needs {needed} blocks of {block_size}, but the "
            f"block table has {block_table.shape[1]} columns"
        )
    if out is None:
        out = query.new_empty(num_tokens, num_q_heads, head_size_v)
    elif tuple(out.shape) != (num_tokens, num_q_heads, head_size_v):
        raise ValueError(f"out must have shape {(num_tokens, num_q_heads, head_size_v)}, got {tuple(out.shape)}")
    group = num_q_heads // num_kv_heads
    device = kv_cache_view.device
    for i, seq_len in enumerate(lens):
        q_begin, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        ids = block_table[i, : -(-seq_len // block_size)].to(device=device, dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(
                f"request {i} reads block ids {ids.tolist()} but the cache has {num_blocks} "
                "kernel blocks; map manager block tables to kernel blocks first"
            )
        # [nb, H, N, C] -> [H, nb * N, C], then drop the unused tail of the last page.
        pages = kv_cache_view[ids].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, kv_cache_view.shape[-1])
        pages = pages[:, :seq_len].float()
        keys = pages[..., :head_size].unsqueeze(1)
        values = pages[..., head_size : head_size + head_size_v].unsqueeze(1)
        q = query[q_begin:q_end].to(device=device, dtype=torch.float32)
        q = q.view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [H, G, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores.masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result = torch.matmul(probs, values)  # [H, G, q_len, head_size_v]
        out[q_begin:q_end] = result.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_size_v).to(out.dtype)
    return out
