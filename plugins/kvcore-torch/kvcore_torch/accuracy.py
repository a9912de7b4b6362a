"""How far attention over a quantized cache is from exact attention: the reference's error.

K and V are drawn as real ones look: unit normal noise around a per-channel mean (the mean
itself unit normal, per KV head and channel); queries are unit normal. The cache is planned
and written through kvcore (:func:`kvcore_torch.write_kv` with the mode's
:class:`~kvcore.plugins.backend.KVQuantState`), read back by :func:`kvcore_torch.paged_attention`
and compared with float64 attention over the unquantized K/V.
"""

from __future__ import annotations

import torch

from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache, allocate_scale_views
from kvcore.plugins.backend import KVQuantState
from kvcore.specs import FullAttentionSpec
from kvcore.specs.quant import quantize_specs
from kvcore_torch.attention import paged_attention
from kvcore_torch.cache_write import write_kv


def attention_error(
    kv_cache_dtype: str,
    *,
    q_heads: int = 8,
    kv_heads: int = 2,
    head_size: int = 64,
    context: int = 256,
    requests: int = 4,
    block_size: int = 16,
    layout: str = "LBNHC",
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> float:
    """Relative L2 error of one decode step over ``requests`` x ``context`` cached tokens stored
    as ``kv_cache_dtype`` ("auto": float32), against float64 attention over the same K/V."""
    spec = FullAttentionSpec(block_size, kv_heads, head_size, torch.float32)
    spec = quantize_specs({"layer": spec}, kv_cache_dtype)["layer"]
    blocks_per_request = -(-context // block_size)
    config = plan_kv_cache({"layer": spec}, layout, num_blocks=requests * blocks_per_request + 1)
    view = allocate_kv_cache(config, device)["layer"]
    raw = torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())
    scales = allocate_scale_views(config, raw).get("layer")
    state = None if spec.kv_quant is None else KVQuantState(spec.kv_quant, spec.dtype, 1.0, 1.0, scales)
    gen = torch.Generator().manual_seed(seed)

    def around_a_mean(*shape: int) -> torch.Tensor:
        mean = torch.randn(kv_heads, head_size, generator=gen)
        return (mean + torch.randn(*shape, kv_heads, head_size, generator=gen)).to(device)

    keys, values = around_a_mean(requests, context), around_a_mean(requests, context)
    query = torch.randn(requests, q_heads, head_size, generator=gen).to(device)
    table = torch.arange(1, requests * blocks_per_request + 1, dtype=torch.int32, device=device)
    table = table.view(requests, blocks_per_request)
    positions = torch.arange(context, device=device)
    slots = (table[:, positions // block_size].long() * block_size + positions % block_size).flatten()
    write_kv(view, keys.flatten(0, 1), values.flatten(0, 1), slots, head_size,
             **({} if state is None else {"kv_quant": state}))
    scale = head_size**-0.5
    starts = torch.arange(requests + 1, dtype=torch.int32, device=device)
    lens = torch.full((requests,), context, dtype=torch.int32, device=device)
    out = paged_attention(query, view, table, starts, lens, head_size=head_size, scale=scale,
                          **({} if state is None else {"kv_quant": state}))
    group = q_heads // kv_heads
    k, v = (t.double().repeat_interleave(group, 2) for t in (keys, values))  # [R, S, Hq, D]
    weights = torch.softmax(torch.einsum("rhd,rshd->rhs", query.double(), k) * scale, dim=-1)
    exact = torch.einsum("rhs,rshd->rhd", weights, v)
    return ((out.double() - exact).norm() / exact.norm()).item()
