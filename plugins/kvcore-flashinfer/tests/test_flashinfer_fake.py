"""kvcore-flashinfer's side of the contract on CPU, with FlashInfer replaced by ``fake_flashinfer``.

Checks what the backend hands FlashInfer — page tables, NHD/HND views of
every layout, ``window_left``, scale, one plan per step, CUDA-graph plans —
against the kit's float64 reference. The real kernels run in test_flashinfer_gpu.py.
"""

from __future__ import annotations

import fake_flashinfer
import pytest
import torch

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.specs import FullAttentionSpec
from kvcore.testing import LAYOUTS, SPLITTABLE, build_cache, dense_reference, make_batch
from kvcore_flashinfer import FlashInferAttentionBackend, FlashInferMetadataBuilder, _runtime
from kvcore_flashinfer import bench as fi_bench
from kvcore_triton._checks import INTERPRETED

# NOTE: the stand-in runs kvcore-triton's K/V store on CPU tensors: only through the interpreter.
pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (CPU tensors)")

MIXED = ([17, 40, 9], [17, 6, 1])  # prefill, chunked prefill, decode
DECODE = ([23, 40], [1, 1])


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setattr(_runtime, "flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr("kvcore_flashinfer.builder.flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr("kvcore_flashinfer.backend.flashinfer", lambda: fake_flashinfer)
    monkeypatch.setattr("kvcore_flashinfer.bench.flashinfer", lambda: fake_flashinfer)
    # NOTE: the CUDA-only rules are tested in test_flashinfer_plugin.py; these views live on the CPU
    # (and the tiny models are float32 with head size 16).
    from kvcore.plugins.requirements import KernelRequirements
    from kvcore_flashinfer import plugin as fi_plugin

    monkeypatch.setattr(fi_plugin, "REQUIREMENTS", KernelRequirements())
    monkeypatch.setattr("kvcore_flashinfer.backend.check_view", lambda view, head_size, head_size_v: None)
    monkeypatch.setattr("kvcore_flashinfer.builder._workspace", lambda device: None)


def _common(batch, kernel):
    return CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_tensor,
        block_table_tensor=batch.kernel_table, slot_mapping=batch.slots(kernel, True), num_reqs=len(batch.q_lens),
        num_actual_tokens=sum(batch.q_lens), max_query_len=max(batch.q_lens), max_seq_len=max(batch.seq_lens),
    )


def _run(layout, reqs, *, block_size=16, ratio=1, window=None, q_heads=4, scale=0.3, layers=1):
    from kvcore_torch import write_kv

    seq_lens, q_lens = reqs
    kernel = block_size // ratio
    gen = torch.Generator().manual_seed(0)
    num_blocks = len(seq_lens) * max(-(-n // block_size) for n in seq_lens) + 2
    view, _ = build_cache(layout, block_size, num_blocks, 2, 16, torch.float32, device="cpu",
                          kernel_block_size=kernel if ratio > 1 else None)
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=2, q_heads=q_heads, head_size=16, dtype=torch.float32,
                       num_blocks=num_blocks, block_size=block_size, ratio=ratio)
    write_kv(view, batch.tokens(batch.keys, False), batch.tokens(batch.values, False), batch.slots(kernel, False), 16)
    builder = FlashInferMetadataBuilder(FullAttentionSpec(kernel, 2, 16, torch.float32), ["a"], "cpu",
                                        max_num_seqs=8, max_model_len=512)
    metadata = builder.build(0, _common(batch, kernel))
    for _ in range(layers):
        out = FlashInferAttentionBackend.forward(
            batch.query, batch.tokens(batch.keys, True), batch.tokens(batch.values, True), view, metadata,
            head_size=16, scale=scale, sliding_window=window)
    torch.testing.assert_close(out.double(), dense_reference(batch, scale, window), atol=1e-5, rtol=1e-5)
    return builder, metadata


@pytest.mark.parametrize(
    ("layout", "reqs"),
    [(layout, MIXED) for layout in LAYOUTS] + [(layout, DECODE) for layout in SPLITTABLE],
    ids=[f"mixed-{x.name}" for x in LAYOUTS] + [f"decode-{x.name}" for x in SPLITTABLE],
)
def test_views_of_every_layout_reach_flashinfer_correctly(layout, reqs):
    _, metadata = _run(layout, reqs)
    (key, wrapper), = metadata.planned.items()
    assert type(wrapper).__name__.startswith("BatchDecode" if reqs is DECODE else "BatchPrefill")
    # A page's heads further apart than its tokens: HND, else NHD.
    assert key.layout == ("HND" if layout.name.index("H") < layout.name.index("N") else "NHD")


@pytest.mark.parametrize("layout", SPLITTABLE, ids=lambda x: x.name)
def test_kernel_block_splits(layout):
    _run(layout, MIXED, block_size=64, ratio=4)


@pytest.mark.parametrize("window", [1, 5, 24])
def test_sliding_window_is_window_left_minus_one(window):
    _, metadata = _run("LBHNC", MIXED, window=window)
    assert next(iter(metadata.planned)).window_left == window - 1


def test_unsupported_decode_group_goes_through_prefill():
    _, metadata = _run("BLNHC", DECODE, q_heads=10)  # 5 query heads per KV head
    assert type(next(iter(metadata.planned.values()))).__name__ == "BatchPrefillWithPagedKVCacheWrapper"


def test_one_plan_per_step_for_many_layers():
    builder, _ = _run("LBNHC", DECODE, layers=3)
    assert builder.num_plans == 1


def test_graph_steps_plan_fixed_size_wrappers_from_host_tensors():
    builder, metadata = _run("LBNHC", DECODE)
    key = next(iter(metadata.planned))
    common = _common(make_batch(torch.Generator().manual_seed(1), [5, 60], [1, 1], kv_heads=2, q_heads=4,
                                head_size=16, dtype=torch.float32, num_blocks=12, block_size=16), 16)
    builder.plan_graph_step(common)
    builder.plan_graph_step(common)
    wrapper = builder._graph[(2, key)]
    assert wrapper.use_cuda_graph and wrapper.plans == 2
    assert wrapper.indptr.tolist() == [0, 1, 5] and wrapper.last.tolist() == [5, 12]
    assert len(wrapper.buffers["paged_kv_indices_buffer"]) == 2 * 32  # batch x pages of max_model_len


def test_engine_tokens_equal_the_torch_backend_with_graph_step_plans():
    # Gemma 3: a sliding and a full KV cache group, scale 24**-0.5; the padded decode steps of
    # the CUDA-graph path run eagerly (capture=False) and plan their fixed-size wrappers too.
    pytest.importorskip("transformers")
    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model
    from kvcore.hf.step import DecodeGraphs

    model = random_model(model_config("gemma3"), seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (21, 6, 30)]
    expected = Engine(model, backend="torch", num_blocks=12, max_num_seqs=3).generate(prompts, 5)
    engine = Engine(model, backend="flashinfer", num_blocks=12, max_num_seqs=3, max_num_batched_tokens=24)
    engine.graphs = DecodeGraphs(engine.device, 3, capture=False)
    assert engine.generate(prompts, 5) == expected
    assert engine.stats().graph_steps > 0
    builders = [g.metadata_builders[0] for groups in engine.kv.attn_groups for g in groups]
    assert len(builders) == 2 and all(b._graph for b in builders)
    assert {k.window_left for b in builders for k in b.keys} == {-1, 23}


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
def test_bench_rows_read_the_view_and_a_native_copy_alike(layout):
    gen = torch.Generator().manual_seed(4)
    view, _ = build_cache(layout, 16, 9, 2, 16, torch.float32, device="cpu")
    view.copy_(torch.randn(view.shape, generator=gen))
    table = torch.tensor([[3, 7, 1], [8, 2, 5]], dtype=torch.int32)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    query = torch.randn(2, 4, 16, generator=gen)
    rows = fi_bench.decode_rows(view, table, lens, query, scale=0.25, time_ms=lambda fn: (fn(), 2.0)[1])
    assert [r["path"].split(" (")[0] for r in rows] == ["flashinfer via kvcore views", "flashinfer native NHD"]
    assert rows[1]["max_abs_diff"] < 1e-6 and rows[0]["native_time_over_time"] == 1.0
