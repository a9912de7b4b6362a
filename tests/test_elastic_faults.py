"""An elastic cache's resize is all or nothing whichever step raises, Ctrl-C included; sizes past
the block pool's limit are refused at create; an Engine that cannot commit memory says so.

Failures come in through the seams ``KVCache.resize`` goes through: ``kv.elastic.backing.commit``
/ ``decommit(start, end)`` and ``kv.block_pool.resize(n)``. A model of the backing memory (the
granules really committed, recorded by those seams) is checked after every call: the cache, its
pool and its zeroer agree on one size, every block below it is backed, and ``committed_bytes``
counts exactly the memory that is.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from _elastic_caches import Faults, make_elastic
from hypothesis import given, settings

from kvcore.errors import InsufficientMemoryError
from kvcore.memory import budget

ERRORS = [KeyboardInterrupt, RuntimeError, InsufficientMemoryError]


@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC", "LHBNC"])
@given(sizes=st.lists(st.integers(2, 16), min_size=1, max_size=5),
       seam=st.sampled_from(["commit", "decommit", "pool"]), fail_at=st.integers(0, 8),
       error=st.sampled_from(ERRORS), held=st.integers(0, 3))
@settings(max_examples=40, deadline=None, derandomize=True)
def test_resize_is_all_or_nothing_whichever_step_raises(layout, sizes, seam, fail_at, error, held):
    kv = make_elastic("uniform", layout, 8, 16)
    kv.block_pool.allocate(held)
    faults = Faults(kv, seam, fail_at, error)
    for n in sizes:
        before = faults.state()
        try:
            kv.resize(n)
        except error:
            assert faults.state() == before, f"resize({n}) raised and changed the cache"
        except ValueError:  # NOTE: a shrink below held blocks is refused
            assert n <= held and faults.state() == before
        else:
            assert kv.num_blocks == n
        faults.check()
    faults.seam = None
    kv.resize(16)  # NOTE: a retry reaches every size, with every new block free
    assert kv.block_pool.num_free_blocks == 15 - held
    faults.check()


def test_an_interrupted_shrink_of_the_engine_leaves_the_next_generate_exact(monkeypatch):
    pytest.importorskip("transformers")
    from _hf_reference import prompts_for

    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config("llama"), seed=1)
    prompts = prompts_for([5, 40, 17, 26])
    expected = Engine(model, backend="torch", num_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=32).generate(prompts, 4)
    engine = Engine(model, backend="torch", num_blocks=4, max_num_blocks=64, max_num_seqs=4,
                    max_num_batched_tokens=32, enable_prefix_caching=True)
    faults = Faults(engine.kv, "decommit", 0)  # NOTE: Ctrl-C in the shrink back when generate returns
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, 4)
    faults.check()
    assert engine.kv.num_blocks > 4  # NOTE: the shrink did not happen, all of it
    faults.seam = None
    assert engine.generate(prompts, 4) == expected
    assert engine.kv.num_blocks == 4
    faults.check()


def test_max_num_blocks_past_the_block_pool_limit_is_refused_before_anything_is_reserved(monkeypatch):
    from kvcore.memory import elastic

    monkeypatch.setattr(elastic, "reserve_backing", lambda *a, **k: pytest.fail("memory was reserved"))
    with pytest.raises(ValueError, match=r"max_num_blocks=67,108,865 is more than the 67,108,864 blocks"):
        make_elastic("uniform", "BLNHC", 4, 2**26 + 1)


def test_an_engine_that_cannot_commit_memory_names_memory_not_the_scheduler(monkeypatch):
    pytest.importorskip("transformers")
    from _hf_reference import prompts_for, reference

    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config("llama"), seed=1)
    engine = Engine(model, backend="torch", num_blocks=2, max_num_blocks=16, max_num_seqs=2)
    prompt = prompts_for([40])
    monkeypatch.setattr(budget, "available_host_memory", lambda: 0)
    with pytest.raises(InsufficientMemoryError, match=r"cannot grow .*cannot commit .*free memory") as info:
        engine.generate(prompt, 4)
    assert isinstance(info.value, ValueError)
    assert engine.kv.num_blocks == 2 and engine.kv.block_pool.num_free_blocks == 1
    monkeypatch.undo()
    assert engine.generate(prompt, 4) == reference(model, prompt, 4)
