"""A whole decode step in one CUDA graph (Triton backend), replayed with new inputs.

The captured step is what an engine captures: map the manager block table to
kernel blocks (``AttentionGroup.build_metadata`` -> ``map_to_kernel_block_table``,
one add into the group's persistent buffer), derive each new token's slot
from the mapped table, then for every layer ``TritonAttentionBackend.forward``
(K/V write + split-K decode attention). Inputs live in persistent buffers;
each replay gets new block tables, sequence lengths, queries, keys and values.
After every replay the outputs and the caches are checked against the torch
backend run eagerly on a snapshot of the caches taken before the replay.

Capture fails if anything in the step synchronizes the device, so this test
also proves that ``forward`` runs no host-side value check by default.
Skipped without CUDA. Run: ``python -m pytest tests/test_cuda_graph_decode.py -q``.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.specs import FullAttentionSpec

pytestmark = [
    pytest.mark.kvcore_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="CUDA graphs run the compiled kernels"),
]

BLOCK, KERNEL_BLOCK, NUM_BLOCKS, LAYERS = 64, 16, 96, ["layers.0.attn", "layers.1.attn"]
REQS, MAX_LEN, KV_HEADS, Q_HEADS, HEAD = 6, 512, 2, 8, 64


class Step:
    """Persistent inputs of one decode step and the caches it works on."""

    def __init__(self, dtype: torch.dtype) -> None:
        from kvcore_triton import TritonAttentionBackend

        dev = torch.device("cuda")
        self.spec = FullAttentionSpec(BLOCK, KV_HEADS, HEAD, dtype)
        config = plan_kv_cache(dict.fromkeys(LAYERS, self.spec), "LBNHC", num_blocks=NUM_BLOCKS)
        self.views = allocate_kv_cache(config, dev, kernel_block_sizes=[KERNEL_BLOCK])
        assert self.views[LAYERS[0]].shape[0] == NUM_BLOCKS * BLOCK // KERNEL_BLOCK
        self.group = AttentionGroup(TritonAttentionBackend, LAYERS, self.spec, 0)
        self.group.create_metadata_builders(dev, max_num_seqs=REQS, max_model_len=MAX_LEN,
                                            kernel_block_size=KERNEL_BLOCK)
        assert self.group.kernel_block_size == KERNEL_BLOCK
        cols = MAX_LEN // BLOCK
        self.block_table = torch.zeros(REQS, cols, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(REQS, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(REQS + 1, dtype=torch.int32, device=dev)
        self.query = torch.zeros(len(LAYERS), REQS, Q_HEADS, HEAD, dtype=dtype, device=dev)
        self.key = torch.zeros(len(LAYERS), REQS, KV_HEADS, HEAD, dtype=dtype, device=dev)
        self.value = torch.zeros_like(self.key)
        self.out = torch.zeros(len(LAYERS), REQS, Q_HEADS, HEAD, dtype=dtype, device=dev)

    def common(self, slot_mapping: torch.Tensor, block_table: torch.Tensor) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table_tensor=block_table,
            slot_mapping=slot_mapping, num_reqs=REQS, num_actual_tokens=REQS, max_query_len=1,
            max_seq_len=MAX_LEN,  # NOTE: an upper bound fixed at capture, as an engine captures
        )

    def run(self, backend) -> None:
        """The step: map tables, derive slots, write + attend in every layer (capturable)."""
        manager = self.common(torch.empty(0, dtype=torch.int64, device="cuda"), self.block_table)
        kernel_table = self.group.build_metadata(manager).block_table_tensor
        pos = (self.seq_lens - 1).long()
        rows = torch.arange(REQS, device="cuda")
        slots = kernel_table[rows, pos // KERNEL_BLOCK].long() * KERNEL_BLOCK + pos % KERNEL_BLOCK
        metadata = self.common(slots, kernel_table)
        for i, name in enumerate(LAYERS):
            backend.forward(
                self.query[i], self.key[i], self.value[i], self.views[name], metadata,
                head_size=HEAD, scale=HEAD**-0.5, out=self.out[i],
            )

    def new_inputs(self, gen: torch.Generator) -> None:
        """Fresh lengths, distinct random blocks per request, random q/k/v and cache contents."""
        lens = torch.randint(1, MAX_LEN + 1, (REQS,), generator=gen)
        lens[0] = MAX_LEN  # one request uses every column
        blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: REQS * (MAX_LEN // BLOCK)]
        self.block_table.copy_(blocks.view(REQS, -1).to(torch.int32))
        self.seq_lens.copy_(lens.to(torch.int32))
        for t in (self.query, self.key, self.value):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        for view in self.views.values():
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))


def _reference(step: Step, snapshot: dict[str, torch.Tensor]):
    """The same step through the torch backend, eagerly, on copies of the caches."""
    from kvcore_torch import TorchAttentionBackend

    ratio = BLOCK // KERNEL_BLOCK
    kernel_table = (step.block_table.long().unsqueeze(-1) * ratio + torch.arange(ratio, device="cuda")).flatten(1)
    pos = (step.seq_lens - 1).long()
    slots = kernel_table[torch.arange(REQS, device="cuda"), pos // KERNEL_BLOCK] * KERNEL_BLOCK + pos % KERNEL_BLOCK
    metadata = step.common(slots, kernel_table.to(torch.int32))
    outs = []
    for i, name in enumerate(LAYERS):
        outs.append(TorchAttentionBackend.forward(
            step.query[i], step.key[i], step.value[i], snapshot[name], metadata, head_size=HEAD, scale=HEAD**-0.5,
        ))
    return torch.stack(outs), snapshot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_replays_in_one_cuda_graph(dtype):
    from kvcore_triton import TritonAttentionBackend

    step = Step(dtype)
    gen = torch.Generator().manual_seed(0)
    step.new_inputs(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run(TritonAttentionBackend)  # compile every kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(TritonAttentionBackend)
    for replay in range(4):
        step.new_inputs(gen)
        snapshot = {name: view.clone() for name, view in step.views.items()}
        step.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected, written = _reference(step, snapshot)
        torch.testing.assert_close(step.out.float(), expected.float(), atol=2e-2, rtol=2e-2, msg=f"replay {replay}")
        for name in LAYERS:
            assert torch.equal(step.views[name], written[name]), f"replay {replay}: {name} cache differs"
