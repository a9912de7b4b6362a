"""kvcore.hf.Engine serves transformers models token for token like ``model.generate``.

Each architecture's tiny random-weight model (float32, peaky logits) serves
prompts of mixed lengths through a cache so small, and with so few sequences
at once, that requests wait, blocks are recycled (and zeroed) and, for the
hybrid models, sliding windows hand blocks back; every prompt's tokens must
equal ``model.generate`` on that prompt alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
PROMPT_LENS = [5, 40, 17, 33, 9, 26]
MAX_NEW = 8


def prompts_for(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompts, max_new_tokens):
    return [
        model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
        for p in prompts
    ]


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(model_config(arch), seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(models):
    prompts = prompts_for(PROMPT_LENS)
    return prompts, {arch: reference(m, prompts, MAX_NEW) for arch, m in models.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_equal_model_generate_with_waiting_and_recycled_blocks(models, references, arch):
    prompts, expected = references
    model = models[arch]
    engine = Engine(model, num_blocks=10, max_num_seqs=3, max_num_batched_tokens=24)
    assert engine.generate(prompts, MAX_NEW) == expected[arch]
    stats = engine.stats()
    assert stats.requests_finished == len(prompts)
    assert stats.blocks_allocated > engine.kv.num_blocks - 1  # blocks came back and went out again
    assert stats.blocks_zeroed == stats.blocks_allocated  # every handed-out block was zeroed first
    assert stats.prefill_tokens + stats.decode_tokens >= sum(PROMPT_LENS) + len(prompts) * (MAX_NEW - 1)
    assert engine.kv.block_pool.num_free_blocks == engine.kv.num_blocks - 1
    assert model.config._attn_implementation == "sdpa"  # restored after serving
    if arch in ("mistral", "gemma3"):
        assert stats.window_freed_blocks > 0


@pytest.mark.parametrize("layout, block_size", [("BLHNC", 8), ("LHBNC", 32)])
def test_layout_and_block_size_change_no_token(models, references, layout, block_size):
    prompts, expected = references
    engine = Engine(models["gemma3"], backend="torch", layout=layout, block_size=block_size, num_blocks=40,
                    max_num_seqs=4)
    assert engine.kv.layout.name == layout
    assert engine.generate(prompts, MAX_NEW) == expected["gemma3"]


def test_garbage_in_recycled_blocks_never_reaches_a_token(models, references):
    # Freed blocks are filled with NaN; a block handed out again is zeroed before the step
    # writes it, and nothing a step reads is stale: the tokens stay exact.
    prompts, expected = references
    engine = Engine(models["llama"], num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16)
    pool, views = engine.kv.block_pool, engine.kv.layer_kv_caches
    free = pool.free

    def poisoning_free(block_ids):
        ids = list(block_ids)
        for view in views.values():
            view[torch.tensor(ids)] = float("nan")
        free(ids)

    pool.free = poisoning_free
    assert engine.generate(prompts, MAX_NEW) == expected["llama"]
    assert engine.stats().blocks_allocated > engine.kv.num_blocks


def test_gemma3_sliding_and_full_layers_get_separate_block_tables(models):
    engine = Engine(models["gemma3"], num_blocks=16)
    groups = engine.kv.config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert len(engine.scheduler.tables) == 2


def test_a_module_whose_window_disagrees_with_its_config_is_refused_when_bound(models, monkeypatch):
    # The window comes from the layer's KV cache group; a module attending with another one
    # would silently read the wrong tokens, so the engine refuses it up front.
    attn = models["gemma3"].model.layers[0].self_attn
    monkeypatch.setattr(attn, "sliding_window", attn.sliding_window + 5)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn attends with sliding_window=29 .* has 24"):
        Engine(models["gemma3"], num_blocks=10)


def test_preempted_requests_are_recomputed_exactly(models):
    # 3 requests of one block each (of 5) all grow into a second block: the newest is preempted.
    prompts = prompts_for([14, 13, 14, 12], seed=4)
    engine = Engine(models["llama"], num_blocks=6, max_num_seqs=3)
    assert engine.generate(prompts, MAX_NEW) == reference(models["llama"], prompts, MAX_NEW)
    assert engine.stats().preemptions > 0


def test_triton_backend_through_the_interpreter():
    # NOTE: Triton needs CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(model_config("gemma3"), seed=1, device=device)
    prompts = prompts_for([21, 6, 30], seed=3)
    expected = reference(model, prompts, 4)
    engine = Engine(model, backend="triton", block_size=16, num_blocks=7, max_num_seqs=2, max_num_batched_tokens=16,
                    cuda_graphs=False)
    assert engine.generate(prompts, 4) == expected
    assert engine.stats().blocks_allocated > engine.kv.num_blocks - 1


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_steps_match_model_generate(backend):
    model = random_model(model_config("gemma3", num_hidden_layers=4), seed=2, device="cuda")
    prompts = prompts_for([5, 40, 17, 33, 9, 26, 70, 3])
    expected = reference(model, prompts, 12)
    # NOTE: 16-token blocks whatever the backend prefers, so 12 blocks force preemption
    engine = Engine(model, backend=backend, num_blocks=12, block_size=16, max_num_seqs=3,
                    max_num_batched_tokens=32, cuda_graphs=True)
    assert engine.generate(prompts, 12) == expected
    stats = engine.stats()
    assert stats.graph_steps > 0 and stats.preemptions + stats.window_freed_blocks > 0


def test_generation_stops_at_eos_like_model_generate(models, references):
    prompts, expected = references
    model = models["qwen3"]
    eos = expected["qwen3"][1][3]  # a token prompt 1 generates mid-way
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        want = reference(model, prompts, MAX_NEW)
        got = Engine(model, num_blocks=24, max_num_seqs=4).generate(prompts, MAX_NEW)
    finally:
        model.generation_config.eos_token_id = old
    assert got == want
    assert got[1][-1] == eos and len(got[1]) <= 4


def test_prefix_caching_changes_no_token_and_skips_prefill(models):
    model = models["gemma3"]
    shared = prompts_for([40], seed=5)[0]
    prompts = [shared + tail for tail in prompts_for([3, 9, 1, 14], seed=6)]
    runs = {}
    for caching in (False, True):
        engine = Engine(model, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=32,
                        enable_prefix_caching=caching)
        runs[caching] = (engine.generate(prompts, 5), engine.stats())
    assert runs[True][0] == runs[False][0] == reference(model, prompts, 5)
    on, off = runs[True][1], runs[False][1]
    assert on.prefix_cache_hits >= 2 and off.prefix_cache_hits == 0
    assert on.prefill_tokens == off.prefill_tokens - on.prefix_cache_hit_tokens
    assert on.blocks_zeroed < off.blocks_zeroed


BAD_REQUESTS = [
    ([], 4, "prompt 1 is empty"),
    ([5, 256, 7], 4, r"prompt 1 holds token ids \[256\] outside the vocabulary 0..255"),
    ([5, -1], 4, "outside the vocabulary"),
    ([5, 6], 0, "max_new_tokens must be at least 1"),
    ([3 + i % 200 for i in range(500)], 20, "needs 520 positions but the model takes at most 512"),
    ([3 + i % 200 for i in range(200)], 4, "needs up to 13 KV cache blocks but the whole cache has 9"),
]


def test_bad_requests_are_refused_before_anything_runs(models):
    engine = Engine(models["llama"], num_blocks=10)
    good = prompts_for([7, 12], seed=9)
    for prompt, max_new, match in BAD_REQUESTS:
        with pytest.raises(ValueError, match=match):
            engine.generate([good[0], prompt, good[1]], max_new)
        assert engine.stats().steps == 0 and not engine.scheduler.has_work
    with pytest.raises(TypeError, match="list of token ids"):
        engine.generate([good[0], "hello"], 3)
    assert engine.generate(good, 3) == reference(models["llama"], good, 3)


def test_a_refused_request_leaves_queued_ones_to_complete(models):
    engine = Engine(models["llama"], num_blocks=10)
    good = prompts_for([7, 12], seed=9)
    first = engine.add_request(good[0], 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 999], 3)
    second = engine.add_request(good[1], 3)
    done = engine.run()
    assert [done[first], done[second]] == reference(models["llama"], good, 3)


def test_model_without_kvcore_context_refuses_kvcore_attention(models):
    model = models["llama"]
    engine = Engine(model, num_blocks=10)
    with engine.serving(), pytest.raises(RuntimeError, match="only runs inside kvcore.hf.Engine"):
        model(torch.tensor([[3, 4, 5]]))
    assert model.config._attn_implementation == "sdpa"


def test_padded_static_decode_step_of_the_cuda_graph_path(models, references):
    # The inputs a CUDA graph replays (static buffers, batches padded to a bucket, slot -1
    # padding, max_seq_len = max_model_len), run eagerly so that CPU tests cover them.
    from kvcore.hf.step import DecodeGraphs

    prompts, expected = references
    engine = Engine(models["mistral"], num_blocks=10, max_num_seqs=3, max_num_batched_tokens=24)
    engine.graphs = DecodeGraphs(engine.device, 3, capture=False)
    assert engine.graphs.sizes == [1, 2, 3]
    assert engine.generate(prompts, MAX_NEW) == expected["mistral"]
    assert engine.stats().graph_steps > 0


def test_readme_serving_example_runs(capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "kvcore.hf" in b)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("['model.layers.0.self_attn', 'model.layers.1.self_attn']")
    assert [len(t) for t in namespace["tokens"]] == [8, 8]
    assert namespace["tokens"] == reference(namespace["model"], [[5, 6, 7, 8], [9, 10]], 8)
