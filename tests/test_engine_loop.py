"""The demo's engine loop at small size: chunked prefill, decode, block recycling.

Invariants: every layer's paged attention output equals dense attention over
the same tokens; blocks freed by finished sequences are filled with NaN, and
when handed out again they read as zero before the step writes them; at the
end every block is back in the pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvcore import KVCache, get_plugin_manager

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PROMPT_LENS = [5, 40, 17, 33, 9, 26]


@pytest.fixture(scope="module")
def ex():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import tiny_engine
        import tiny_model

        yield tiny_model, tiny_engine
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    monkeypatch.delenv("KVCORE_KV_CACHE_LAYOUT", raising=False)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def build(ex, pm, *, backend="torch", layout=None, block_size=16, hybrid=False, num_blocks=8, prompts=PROMPT_LENS,
          max_new=(3, 6, 4, 2, 5, 3), device="cpu"):
    tiny_model, tiny_engine = ex
    config = tiny_model.ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_q_heads=4,
                                    num_kv_heads=2, head_size=16, sliding_window=24 if hybrid else None)
    model = tiny_model.TinyTransformer(config, dtype=torch.float32, device=torch.device(device), seed=3)
    kv = KVCache.create(
        config.kv_cache_specs(block_size, torch.float32),
        {config.layer_name(i): backend for i in range(config.num_layers)},
        device=device, layout=layout, num_blocks=num_blocks, max_num_seqs=3, max_model_len=96,
        plugin_manager=pm,
    )
    engine = tiny_engine.Engine(model, kv, kv.group_of(config.layer_name(0)).backend,
                                token_budget=24, max_num_seqs=3)
    gen = torch.Generator().manual_seed(7)
    for length, new in zip(prompts, max_new):
        engine.add_request(torch.randint(128, (length,), generator=gen).tolist(), new)
    return engine


def run(engine, max_steps=200):
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return steps


def watch_zeroing(engine, ex) -> list[bool]:
    """Wrap the zeroer: record, per launch, whether the blocks held NaN garbage."""
    kv, kernel_rows = engine.kv, ex[1].kernel_rows
    original, saw_garbage = kv.zeroer.zero_block_ids, []

    def zero_block_ids(block_ids):
        saw_garbage.append(any(v[kernel_rows(kv, n, list(block_ids))].isnan().any().item()
                               for n, v in kv.layer_kv_caches.items()))
        original(block_ids)

    kv.zeroer.zero_block_ids = zero_block_ids
    return saw_garbage


@pytest.mark.parametrize(
    "layout, hybrid, block_size, num_blocks",
    [("LBNHC", False, 16, 8), ("BHLNC", True, 16, 8), ("LHBNC", True, 8, 14), ("BLHNC", False, 32, 5)],
)
def test_engine_recycles_zeroed_blocks_and_matches_dense(ex, pm, layout, hybrid, block_size, num_blocks):
    engine = build(ex, pm, layout=layout, hybrid=hybrid, block_size=block_size, num_blocks=num_blocks)
    saw_garbage = watch_zeroing(engine, ex)
    run(engine)  # the engine itself raises if a new block is not all zeros
    kv = engine.kv
    assert len(engine.finished) == len(PROMPT_LENS)
    assert sorted(len(s.tokens) - s.prompt_len for s in engine.finished) == sorted([3, 6, 4, 2, 5, 3])
    assert engine.recycled_blocks > 0 and any(saw_garbage)
    assert (engine.window_freed_blocks > 0) == hybrid
    assert engine.max_abs_error < 1e-4
    assert kv.block_pool.num_free_blocks == kv.num_blocks - 1
    assert engine.tokens_processed == sum(PROMPT_LENS) + sum([3, 6, 4, 2, 5, 3]) - len(PROMPT_LENS)


def test_skipped_zeroing_is_caught(ex, pm):
    engine = build(ex, pm)
    engine.kv.zeroer.zero_block_ids = lambda block_ids: None
    with pytest.raises(AssertionError, match="not zeroed"):
        run(engine)
    assert engine.recycled_blocks > 0


def test_out_of_blocks_for_one_sequence_is_refused(ex, pm):
    engine = build(ex, pm, num_blocks=3, prompts=[], max_new=[])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        engine.add_request(list(range(40)), 4)


def test_triton_engine_with_split_kernel_blocks(ex, pm):
    # NOTE: Triton needs CUDA tensors, or CPU tensors under the interpreter (conftest.py).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = build(ex, pm, backend="triton", block_size=128, num_blocks=3,
                   prompts=[70, 20, 45], max_new=[2, 3, 2], device=device)
    assert engine.kv.kernel_block_sizes == [64]
    saw_garbage = watch_zeroing(engine, ex)
    run(engine)
    assert len(engine.finished) == 3
    assert engine.recycled_blocks > 0 and any(saw_garbage)
    # fp32 dots run as tf32 on the GPU
    assert engine.max_abs_error < (1e-4 if device == "cpu" else 5e-3)
