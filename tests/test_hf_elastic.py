"""kvcore.hf.Engine over an elastic cache: grows instead of preempting, shrinks back after generate."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

PROMPT_LENS = [5, 40, 17, 26]
MAX_NEW = 4


@pytest.fixture(scope="module")
def setup():
    model = random_model(model_config("llama"), seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = Engine(model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32).generate(prompts, MAX_NEW)
    return model, prompts, expected


def test_engine_grows_instead_of_preempting_and_shrinks_back(setup):
    caching = True  # NOTE: the shrink back evicts cached prefix blocks above the start
    model, prompts, expected = setup
    elastic = Engine(model, num_blocks=4, max_num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                     enable_prefix_caching=caching)
    sizes = []
    grow = elastic.scheduler.grow
    elastic.scheduler.grow = lambda short: (grow(short), sizes.append(elastic.kv.num_blocks))[0]
    committed = elastic.kv.committed_bytes
    assert elastic.generate(prompts, MAX_NEW) == expected
    assert elastic.stats().preemptions == 0 and max(sizes) >= 7  # 4 blocks hold 40 tokens at most
    assert elastic.kv.num_blocks == 4 and elastic.kv.committed_bytes == committed
    assert elastic.kv.block_pool.num_free_blocks == 3


def test_engine_admits_what_fits_max_num_blocks_only(setup):
    model, prompts, expected = setup
    elastic = Engine(model, num_blocks=2, max_num_blocks=5, max_num_seqs=2)
    with pytest.raises(ValueError, match="the whole cache has 4"):
        elastic.generate([prompts[1]], 40)
    assert elastic.generate([prompts[2]], MAX_NEW) == [expected[2]]  # 21 tokens: grows from 1 to 2 usable
    assert elastic.kv.num_blocks == 2


def test_example_engines_take_turns_with_the_memory(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "elastic.py"
    spec = importlib.util.spec_from_file_location("elastic_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timeline = module.main(["--device", "cpu", "--rounds", "1", "--requests", "2", "--prompt-len", "20",
                            "--max-new-tokens", "2"])
    start = timeline[0]
    a_peak = max(r["A"] for r in timeline if r["event"].startswith("A "))
    b_peak = max(r["B"] for r in timeline if r["event"].startswith("B "))
    assert a_peak > start["A"] and b_peak > start["B"]
    a_done = next(r for r in timeline if r["event"].startswith("A done"))
    assert a_done["A"] == start["A"] and all(r["A"] == start["A"] for r in timeline if r["event"].startswith("B "))
    assert timeline[-1]["B"] == start["B"]
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    # the cache's own growth (committed bytes), not the process's resident memory
    growth = {n: max(r[n] for r in timeline) - start[n] for n in "AB"}
    assert f"peak KV cache growth (committed): A {growth['A'] / 2**20:.1f} MiB, B {growth['B'] / 2**20:.1f} MiB" in out


def test_engine_preempts_when_memory_runs_out(setup, monkeypatch):
    from kvcore.memory import budget

    model, prompts, expected = setup
    elastic = Engine(model, num_blocks=4, max_num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32)
    monkeypatch.setattr(budget, "available_host_memory", lambda: 0)  # no grow can commit
    # 26 and 17 tokens: both start (3 blocks), then the second needs a 4th: preempted, not grown
    assert elastic.generate([prompts[3], prompts[2]], MAX_NEW) == [expected[3], expected[2]]
    assert elastic.kv.num_blocks == 4 and elastic.stats().preemptions > 0
