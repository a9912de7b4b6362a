"""A decode launch captured in a CUDA graph stays correct as the batch grows (GPU only)."""

from __future__ import annotations

import pytest
import torch
from triton_paged_cases import build_cache

import kvcore_torch
from kvcore_triton import KernelConfig, paged_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

REQS, KV_HEADS, Q_HEADS, HEAD, BLOCK, BOUND = 6, 2, 8, 64, 16, 256


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_graph_replay_matches_torch_backend(num_splits):
    gen = torch.Generator(device="cuda").manual_seed(3)
    width = BOUND // BLOCK
    view, _ = build_cache("BLNHC", BLOCK, REQS * width + 1, KV_HEADS, HEAD, torch.float32, device="cuda")
    view.normal_(generator=gen)
    query = torch.empty(REQS, Q_HEADS, HEAD, device="cuda")
    table = torch.empty(REQS, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.empty(REQS, dtype=torch.int32, device="cuda")
    qsl = torch.arange(REQS + 1, dtype=torch.int32, device="cuda")
    out = torch.full((REQS, Q_HEADS, HEAD), float("nan"), device="cuda")
    config = KernelConfig(tile=16, num_splits=num_splits)

    def step():
        # NOTE: max_seq_len is the graph's bound, not this batch's longest context.
        paged_attention(query, view, table, qsl, seq_lens, head_size=HEAD, scale=HEAD**-0.5, out=out,
                        max_query_len=1, max_seq_len=BOUND, config=config)

    def refill(lo, hi):
        query.normal_(generator=gen)
        table.copy_((torch.randperm(REQS * width, device="cuda", generator=gen) + 1).view(REQS, width))
        seq_lens.copy_(torch.randint(lo, hi, (REQS,), device="cuda", generator=gen))

    refill(1, 40)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lo, hi in ((1, 40), (100, 200), (200, BOUND + 1)):
        refill(lo, hi)
        out.fill_(float("nan"))
        graph.replay()
        ref = kvcore_torch.paged_attention(query, view, table, qsl, seq_lens, head_size=HEAD, scale=HEAD**-0.5)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
