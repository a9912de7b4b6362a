"""FlashInfer through kvcore's views against the kit's float64 reference (CUDA + FlashInfer only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.specs import FullAttentionSpec
from kvcore.testing import LAYOUTS, SPLITTABLE, build_cache, dense_reference, make_batch
from kvcore_flashinfer import FlashInferAttentionBackend, FlashInferMetadataBuilder

pytestmark = [
    pytest.mark.kvcore_gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
        reason="needs CUDA and FlashInfer",
    ),
]
DECODE = ([23, 40, 300], [1, 1, 1])
MIXED = ([17, 40, 9, 200], [17, 6, 1, 200])  # prefill, chunked prefill, decode, long prefill
TOL = 2e-2  # bf16 inputs, float64 reference


def _common(batch, kernel_block_size, device):
    qsl, lens = batch.query_start_loc, batch.seq_lens_tensor
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=lens.to(device),
        block_table_tensor=batch.kernel_table.to(device),
        slot_mapping=batch.slots(kernel_block_size, True).to(device), num_reqs=len(batch.q_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(batch.q_lens), max_seq_len=max(batch.seq_lens),
    )


def _run(layout, reqs, *, block_size=16, ratio=1, head_size=128, dtype=torch.bfloat16, window=None, q_heads=8,
         seed=0):
    from kvcore_triton import write_kv

    seq_lens, q_lens = reqs
    gen = torch.Generator().manual_seed(seed)
    kernel = block_size // ratio
    num_blocks = len(seq_lens) * max(-(-n // block_size) for n in seq_lens) + 2
    view, other = build_cache(layout, block_size, num_blocks, 2, head_size, dtype, device="cuda",
                              kernel_block_size=kernel if ratio > 1 else None)
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=2, q_heads=q_heads, head_size=head_size, dtype=dtype,
                       num_blocks=num_blocks, block_size=block_size, ratio=ratio)
    write_kv(view, batch.tokens(batch.keys, False).cuda(), batch.tokens(batch.values, False).cuda(),
             batch.slots(kernel, False).cuda(), head_size)
    spec = FullAttentionSpec(kernel, 2, head_size, dtype)
    builder = FlashInferMetadataBuilder(spec, ["a", "b"], "cuda", max_num_seqs=8, max_model_len=4096)
    metadata = builder.build(0, _common(batch, kernel, "cuda"))
    scale = head_size**-0.5
    out = FlashInferAttentionBackend.forward(
        batch.query.cuda(), batch.tokens(batch.keys, True).cuda(), batch.tokens(batch.values, True).cuda(),
        view, metadata, head_size=head_size, scale=scale, sliding_window=window,
    )
    ref = dense_reference(batch, scale, window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL, rtol=TOL)
    assert torch.count_nonzero(other) == 0, "forward touched another layer"
    return builder, metadata


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_every_layout_matches_the_reference(layout, reqs):
    _run(layout, reqs)


@pytest.mark.parametrize("layout", SPLITTABLE, ids=lambda x: x.name)
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_kernel_block_splits(layout, reqs):
    _run(layout, reqs, block_size=64, ratio=4)


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_sizes_and_dtypes(head_size, dtype):
    _run("LBNHC", MIXED, head_size=head_size, dtype=dtype)


@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [1, 5, 24])
def test_sliding_window(reqs, window):
    _run("LBHNC", reqs, window=window)


@pytest.mark.parametrize("q_heads", [2, 10])  # group 5 decodes through the prefill kernel
def test_gqa_groups(q_heads):
    _run("BLNHC", DECODE, q_heads=q_heads)


def test_one_plan_per_step_whatever_the_layer_count():
    builder, metadata = _run("LBNHC", MIXED)
    wrapper = next(iter(metadata.planned.values()))
    for _ in range(3):  # more layers of the same group and step reuse the plan
        assert metadata.wrapper(next(iter(metadata.planned))) is wrapper
    assert builder.num_plans == 1


def test_decode_replays_from_a_cuda_graph():
    from kvcore_triton import write_kv

    gen = torch.Generator().manual_seed(1)
    view, _ = build_cache("LBNHC", 16, 40, 2, 128, torch.bfloat16, device="cuda")
    spec = FullAttentionSpec(16, 2, 128, torch.bfloat16)
    builder = FlashInferMetadataBuilder(spec, ["a"], "cuda", max_num_seqs=4, max_model_len=512)
    static = {}

    def step(batch):
        common = _common(batch, 16, "cuda")
        table = torch.zeros(2, 7, dtype=torch.int32)
        table[:, : batch.kernel_table.shape[1]] = batch.kernel_table
        for name, value in (("query_start_loc", common.query_start_loc), ("seq_lens", common.seq_lens),
                            ("block_table_tensor", table.flatten()), ("slot_mapping", common.slot_mapping)):
            static[name].copy_(value)
        host = CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_tensor,
            block_table_tensor=batch.kernel_table, slot_mapping=common.slot_mapping.cpu(), num_reqs=2,
            num_actual_tokens=2, max_query_len=1, max_seq_len=512,
        )
        builder.plan_graph_step(host)
        static["q"].copy_(batch.query.cuda())
        static["k"].copy_(batch.tokens(batch.keys, True).cuda())
        static["v"].copy_(batch.tokens(batch.values, True).cuda())
        write_kv(view, batch.tokens(batch.keys, False).cuda(), batch.tokens(batch.values, False).cuda(),
                 batch.slots(16, False).cuda(), 128)

    def batch_of(lens):
        return make_batch(gen, lens, [1, 1], kv_heads=2, q_heads=8, head_size=128, dtype=torch.bfloat16,
                          num_blocks=40, block_size=16)

    first = batch_of([30, 100])
    static.update(query_start_loc=torch.zeros(3, dtype=torch.int32, device="cuda"),
                  seq_lens=torch.zeros(2, dtype=torch.int32, device="cuda"),
                  block_table_tensor=torch.zeros(2 * 7, dtype=torch.int32, device="cuda"),
                  slot_mapping=torch.zeros(2, dtype=torch.int64, device="cuda"),
                  q=torch.zeros(2, 8, 128, dtype=torch.bfloat16, device="cuda"),
                  k=torch.zeros(2, 2, 128, dtype=torch.bfloat16, device="cuda"),
                  v=torch.zeros(2, 2, 128, dtype=torch.bfloat16, device="cuda"))
    common = CommonAttentionMetadata(
        query_start_loc=static["query_start_loc"], seq_lens=static["seq_lens"],
        block_table_tensor=static["block_table_tensor"].view(2, 7), slot_mapping=static["slot_mapping"],
        num_reqs=2, num_actual_tokens=2, max_query_len=1, max_seq_len=512,
    )
    kwargs = dict(head_size=128, scale=128**-0.5)
    step(first)
    FlashInferAttentionBackend.forward(static["q"], static["k"], static["v"], view, builder.build(0, common), **kwargs)
    step(first)  # the eager run above taught the builder its plan key
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FlashInferAttentionBackend.forward(static["q"], static["k"], static["v"], view,
                                                 builder.build(0, common), **kwargs)
    for lens in ([30, 100], [77, 5], [111, 64]):
        batch = batch_of(lens)
        step(batch)
        graph.replay()
        torch.testing.assert_close(out.cpu().double(), dense_reference(batch, 128**-0.5), atol=TOL, rtol=TOL)
