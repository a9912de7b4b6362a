"""FlashInfer's decode through kvcore's views beside FlashInfer on its own paged tensor (for bench_decode.py).

The same K/V, block table and queries: once read by the ``flashinfer``
backend's planned wrapper straight from a kvcore kernel view, once by a
plain ``BatchDecodeWithPagedKVCacheWrapper`` over a contiguous
``[pages, 2, page, heads, dim]`` copy, as FlashInfer's own users hold it. The
time ratio native / views is the price of kvcore's layouts (1.0: none).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvcore.plugins.backend import CommonAttentionMetadata, KVQuantState
from kvcore.specs import FullAttentionSpec
from kvcore_flashinfer._runtime import flashinfer, kv_pair
from kvcore_flashinfer.backend import FlashInferAttentionBackend
from kvcore_flashinfer.builder import WORKSPACE_BYTES, FlashInferMetadataBuilder
from kvcore_flashinfer.paging import page_table


def decode_rows(
    view: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    query: torch.Tensor,
    *,
    scale: float,
    time_ms: Callable[[Callable[[], object]], float],
    reference: torch.Tensor | None = None,
    kv_quant: KVQuantState | None = None,
    tensor_cores: bool = False,
) -> list[dict]:
    """Time both ways of decoding ``query`` (``[R, Hq, D]``) over ``view`` ``[B, H, N, 2D]``
    (an fp8 view with its per-tensor ``kv_quant``: FlashInfer's fp8 decode, scales at run)."""
    fi = flashinfer()
    num_reqs, (_, kv_heads, page, width) = query.shape[0], view.shape
    head = width // 2
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=view.device)
    quant = None if kv_quant is None else kv_quant.kv_quant
    builder = FlashInferMetadataBuilder(FullAttentionSpec(page, kv_heads, head, view.dtype, kv_quant=quant),
                                        ["bench"], view.device, max_num_seqs=num_reqs,
                                        max_model_len=int(seq_lens.max()))
    builder.use_tensor_cores = tensor_cores
    scales = {} if kv_quant is None else {"k_scale": kv_quant.k_scale, "v_scale": kv_quant.v_scale}
    common = CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq_lens, block_table_tensor=table,
        slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64, device=view.device), num_reqs=num_reqs,
        num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=int(seq_lens.max()),
    )
    metadata = attrs.evolve(builder.build(0, common), kv_quant=kv_quant)
    # NOTE: this step's K/V are padding (slot -1): nothing is written, the planned wrapper is timed.
    zeros = query.new_zeros(num_reqs, kv_heads, head)
    out = FlashInferAttentionBackend.forward(query, zeros, zeros, view, metadata, head_size=head, scale=scale)
    wrapper = next(iter(metadata.planned.values()))
    kind, k_cache, v_cache = kv_pair(view, head)
    views_ms = time_ms(lambda: wrapper.run(query, (k_cache, v_cache), **scales))
    nhd = (k_cache, v_cache) if kind == "NHD" else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    native = torch.stack(nhd, dim=1).contiguous()  # [pages, 2, page, heads, dim]
    own = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=view.device), "NHD",
        use_tensor_cores=tensor_cores)
    pages = page_table(table, seq_lens, page)
    own.plan(pages.indptr, pages.indices, pages.last_page_len, query.shape[1], kv_heads, head, page,
             q_data_type=query.dtype, kv_data_type=view.dtype, sm_scale=scale)
    native_ms = time_ms(lambda: own.run(query, native, **scales))
    native_out = own.run(query, native, **scales)
    native = None
    reference = out if reference is None else reference
    what = "" if kv_quant is None else f" {str(view.dtype).removeprefix('torch.')}"
    what += " tensor cores" if tensor_cores else ""
    return [
        {"path": f"flashinfer{what} via kvcore views ({kind})", "ms": views_ms,
         "native_time_over_time": native_ms / views_ms,
         "max_abs_diff": (out.float() - reference.float()).abs().max().item()},
        {"path": f"flashinfer{what} native NHD", "ms": native_ms, "native_time_over_time": 1.0,
         "max_abs_diff": (native_out.float() - reference.float()).abs().max().item()},
    ]
