"""The metadata builder: FlashInfer's page tables and wrapper plans, once per step per KV cache group.

``build`` runs once per step for every layer of a KV cache group (kvcore
hands the same metadata object to each of them). It packs the step's page
table on the host; the first layer's ``forward`` then plans a FlashInfer
wrapper for what only the layer knows (query heads, dtype, scale, window,
layout), and every later layer of the group reuses that plan.

CUDA graphs: :meth:`FlashInferMetadataBuilder.plan_graph_step` plans one
``use_cuda_graph`` decode wrapper per batch size (fixed index buffers) from
host tensors, before the graph is captured and before every replay; inside a
capture, ``build`` returns metadata bound to that wrapper, so the graph holds
only the K/V store and FlashInfer's ``run``.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from kvcore.errors import KVCoreError
from kvcore.plugins.backend import AttentionMetadataBuilder, CommonAttentionMetadata, KVQuantState
from kvcore_flashinfer._runtime import DECODE_GROUPS, flashinfer
from kvcore_flashinfer.paging import PageTable, page_table

#: Bytes of FlashInfer's float workspace (split-KV partial results), shared per device.
WORKSPACE_BYTES = 128 * 1024 * 1024


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    # NOTE: one buffer per device for every wrapper: their runs never overlap on the stream.
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


@attrs.frozen
class PlanKey:
    """What a plan depends on beyond the page table; layers of one group normally share one."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    layout: str
    window_left: int
    scale: float
    #: The cache's dtype (fp8 for a per-tensor quantized cache; else the query's); None: ``dtype``.
    kv_dtype: torch.dtype | None = None

    @property
    def decode_kernel(self) -> bool:
        """Whether FlashInfer's CUDA-core decode kernel is built for this GQA group size."""
        return self.num_q_heads // self.num_kv_heads in DECODE_GROUPS


@attrs.define(eq=False)
class FlashInferMetadata:
    """One step of one KV cache group: the common metadata, its page table and the plans made on it."""

    common: CommonAttentionMetadata = attrs.field(repr=False)
    builder: FlashInferMetadataBuilder = attrs.field(repr=False)
    #: Host page table and query offsets (None inside a CUDA-graph capture).
    pages: PageTable | None = attrs.field(repr=False)
    qo_indptr: torch.Tensor | None = attrs.field(repr=False)
    #: Batch size of the CUDA graph being captured, else None.
    graph_size: int | None = None
    #: Wrappers planned for this step, by key (one per group in practice).
    planned: dict[PlanKey, Any] = attrs.field(factory=dict, repr=False)
    #: The layer's quantization (a per-tensor fp8 cache), set per layer by kvcore.
    kv_quant: KVQuantState | None = None

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping

    def wrapper(self, key: PlanKey) -> Any:
        """The wrapper planned for ``key`` in this step (planned on first request)."""
        found = self.planned.get(key)
        if found is None:
            found = self.planned[key] = self.builder.plan(self, key)
        return found


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Plans FlashInfer's paged wrappers for one KV cache group (one builder per micro-batch)."""

    #: Decode with FlashInfer's tensor-core kernel (the prefill module) instead of its CUDA-core one.
    use_tensor_cores = False

    def __init__(self, kv_cache_spec, layer_names, device, *, max_num_seqs, max_model_len, block_table_width=None):
        super().__init__(kv_cache_spec, layer_names, device, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, block_table_width=block_table_width)
        #: Tokens per page: the kernel block size (the builder gets the spec of kernel blocks).
        self.page_size = kv_cache_spec.block_size
        self.max_pages = -(-max_model_len // self.page_size)
        #: Plan keys seen by eager forwards; graph steps plan each of them.
        self.keys: list[PlanKey] = []
        #: ``wrapper.plan`` calls so far (one per step and group, whatever the layer count).
        self.num_plans = 0
        self._eager: dict[tuple[str, PlanKey], Any] = {}
        self._graph: dict[tuple[int, PlanKey], Any] = {}

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, **kwargs: Any):
        common = common_attn_metadata
        if common.num_actual_tokens and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return FlashInferMetadata(common, self, None, None, graph_size=common.num_reqs)
        # NOTE: one device-to-host copy per step and group (FlashInfer schedules on the host);
        # CUDA-graph steps plan from host tensors instead (plan_graph_step).
        seq_lens = common.seq_lens[: common.num_reqs].cpu()
        pages = page_table(common.block_table_tensor, seq_lens, self.page_size)
        qo_indptr = common.query_start_loc[: common.num_reqs + 1].to("cpu", torch.int32)
        return FlashInferMetadata(common, self, pages, qo_indptr)

    # -- planning ------------------------------------------------------------------------

    def _new_wrapper(self, kind: str, key: PlanKey, graph_size: int | None = None) -> Any:
        fi = flashinfer()
        workspace = _workspace(self.device)
        if kind == "prefill":
            return fi.BatchPrefillWithPagedKVCacheWrapper(workspace, key.layout)
        if graph_size is None:
            return fi.BatchDecodeWithPagedKVCacheWrapper(workspace, key.layout, use_tensor_cores=self.use_tensor_cores)
        ints = functools.partial(torch.zeros, dtype=torch.int32, device=self.device)
        return fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, key.layout, use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=ints(graph_size + 1),
            paged_kv_indices_buffer=ints(graph_size * self.max_pages),
            paged_kv_last_page_len_buffer=ints(graph_size),
        )

    def _plan_decode(self, wrapper: Any, pages: PageTable, key: PlanKey) -> None:
        self.num_plans += 1
        wrapper.plan(
            pages.indptr, pages.indices, pages.last_page_len, key.num_q_heads, key.num_kv_heads,
            key.head_size, self.page_size, window_left=key.window_left, q_data_type=key.dtype,
            kv_data_type=key.kv_dtype or key.dtype, sm_scale=key.scale,
        )

    def plan(self, metadata: FlashInferMetadata, key: PlanKey) -> Any:
        """A wrapper planned for ``metadata``'s step and ``key`` (called once per step and key)."""
        if key not in self.keys:
            self.keys.append(key)
        if metadata.graph_size is not None:
            wrapper = self._graph.get((metadata.graph_size, key))
            if wrapper is None:
                raise KVCoreError(
                    f"no FlashInfer CUDA-graph plan for batch size {metadata.graph_size} and {key}; "
                    "call plan_graph_step() with the step's host metadata before capturing"
                )
            return wrapper
        pages = metadata.pages
        if metadata.common.max_query_len == 1 and key.decode_kernel:
            wrapper = self._eager.get(("decode", key)) or self._eager.setdefault(
                ("decode", key), self._new_wrapper("decode", key))
            self._plan_decode(wrapper, pages, key)
            return wrapper
        wrapper = self._eager.get(("prefill", key)) or self._eager.setdefault(
            ("prefill", key), self._new_wrapper("prefill", key))
        self.num_plans += 1
        wrapper.plan(
            metadata.qo_indptr, pages.indptr, pages.indices, pages.last_page_len, key.num_q_heads,
            key.num_kv_heads, key.head_size, self.page_size, causal=metadata.common.causal,
            window_left=key.window_left, q_data_type=key.dtype, kv_data_type=key.kv_dtype or key.dtype,
            sm_scale=key.scale,
        )
        return wrapper

    def plan_graph_step(self, common: CommonAttentionMetadata) -> None:
        """Plan the CUDA-graph decode wrappers of batch size ``common.num_reqs`` from host tensors.

        ``common`` holds CPU tensors (seq lens, kernel block table) of a decode
        step padded to the graph's batch size. Call it before capturing that
        size and before each replay; it plans every key the eager forwards met
        (none yet: nothing to plan, run one eager step first).
        """
        size = common.num_reqs
        pages = page_table(common.block_table_tensor, common.seq_lens[:size], self.page_size)
        for key in self.keys:
            if not key.decode_kernel:
                raise KVCoreError(
                    f"FlashInfer's CUDA-graph decode takes {list(DECODE_GROUPS)} query heads per KV head, "
                    f"got {key.num_q_heads // key.num_kv_heads}; run this model with cuda_graphs=False"
                )
            wrapper = self._graph.get((size, key))
            if wrapper is None:
                wrapper = self._graph[(size, key)] = self._new_wrapper("decode", key, graph_size=size)
            self._plan_decode(wrapper, pages, key)
