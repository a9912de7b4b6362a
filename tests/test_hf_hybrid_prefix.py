"""Prefix caching for hybrid models: a state checkpoint at each multiple of
``state_checkpoint_tokens`` a prefill passes, restored into a new request's slot beside its cached
attention blocks. Float32 tokens equal caching off and ``model.generate`` for every served hybrid,
with hits at several depths, evictions, preemption and NaN in every stale byte."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore_triton._checks import INTERPRETED  # noqa: E402

HYBRIDS = ["bamba", "granitemoehybrid", "granitemoehybrid-dense", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next"]
MAX_NEW = 4


def fill_nan(engine, seed=3):
    """Stale bytes a previous owner left: random floats everywhere, NaN in every state slot."""
    view = next(iter(engine.kv.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    gen = torch.Generator().manual_seed(seed)
    # NOTE: an elastic cache's memory past its committed ranges was given back (and cannot be written)
    spans = [(0, raw.numel())] if engine.kv.elastic is None else engine.kv.elastic._committed
    for start, end in spans:
        raw[start:end].view(torch.float32).copy_(torch.randn((end - start) // 4, generator=gen))
    for name in engine.mixers.layers:
        engine.kv.kv_caches[name].view(torch.int8).fill_(-1)  # NOTE: all bits set: NaN in any float type


def shared_prompts():
    """Prompts sharing 40, 40, 33, 16, 40 and 10 tokens of one prefix."""
    common = prompts_for([40], seed=9)[0]
    tails = prompts_for([5, 12, 3, 20, 9, 4], seed=10)
    return [common[:k] + t for k, t in zip([40, 40, 33, 16, 40, 10], tails)]


def one_by_one(engine, prompts):
    """Each prompt served alone, after the previous ones finished (their prefixes all cached)."""
    return [engine.generate([prompt], MAX_NEW)[0] for prompt in prompts]


def recorded_hits(engine):
    """The depth of every prefix hit, recorded as requests are admitted."""
    depths, admit = [], engine.scheduler._admit_cached

    def recording(request):
        admit(request)
        depths.append(request.num_computed)

    engine.scheduler._admit_cached = recording
    return depths


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(model_config(arch), seed=4) for arch in HYBRIDS}


def make_engine(model, **kwargs):
    return Engine(model, **{"num_blocks": 40, "max_num_seqs": 3, "max_num_batched_tokens": 32, "block_size": 8,
                            "enable_prefix_caching": True, **kwargs})


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hits_at_several_depths_give_the_tokens_of_caching_off(models, arch):
    model, prompts = models[arch], shared_prompts()
    expected = reference(model, prompts, MAX_NEW)
    off = make_engine(model, enable_prefix_caching=False)
    fill_nan(off)
    assert off.generate(prompts, MAX_NEW) == expected
    engine = make_engine(model, max_num_seqs=8)
    fill_nan(engine)
    depths = recorded_hits(engine)
    assert one_by_one(engine, prompts) == expected
    assert depths == [0, 40, 32, 16, 40, 8]  # NOTE: the deepest multiple of 8 each shares with the others
    assert engine.stats().prefix_cache_hit_tokens == sum(depths) and engine.stats().prefix_cache_hits == 5
    assert engine.generate(prompts, MAX_NEW) == expected  # NOTE: together, hits as requests are admitted


def test_64_token_blocks_hit_at_every_multiple_and_never_below(models):
    model = models["bamba"]
    common = prompts_for([160], seed=12)[0]
    tails = prompts_for([7, 7, 7, 7], seed=13)
    first = common + tails[0]
    later = [common[:128] + tails[1], common[:64] + tails[2], common[:63] + tails[3]]
    engine = Engine(model, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=256, block_size=64,
                    enable_prefix_caching=True)
    fill_nan(engine)
    depths = recorded_hits(engine)
    assert engine.generate([first], MAX_NEW) == reference(model, [first], MAX_NEW)
    for prompt, depth in zip(later, [128, 64, 0]):
        depths.clear()
        assert engine.generate([prompt], MAX_NEW) == reference(model, [prompt], MAX_NEW)
        assert depths == [depth]


def test_checkpoints_only_at_multiples_of_state_checkpoint_tokens(models):
    model = models["lfm2"]
    engine = make_engine(model, max_num_seqs=8, state_checkpoint_tokens=16)
    depths = recorded_hits(engine)
    prompts = shared_prompts()
    assert one_by_one(engine, prompts) == reference(model, prompts, MAX_NEW)
    assert depths == [0, 32, 32, 16, 32, 0]  # NOTE: attention blocks of 8 tokens, states every 16
    with pytest.raises(ValueError, match=r"state_checkpoint_tokens=12 is not a multiple of the 8-token"):
        make_engine(model, state_checkpoint_tokens=12)
    with pytest.raises(ValueError, match="state_checkpoint_tokens must be a positive integer"):
        make_engine(model, state_checkpoint_tokens=0)


def test_the_unified_plan_refuses_prefix_caching_by_name(models):
    with pytest.raises(ValueError, match="prefix caching serves the hybrid 'bamba' only with separate_state_pages"):
        make_engine(models["bamba"], separate_state_pages=False)


def test_checkpoints_are_evicted_least_recently_used_and_stay_exact(models):
    model = models["nemotron_h"]
    # NOTE: one sequence at a time: the state region holds one slot and one checkpoint.
    engine = make_engine(model, max_num_seqs=1)
    assert engine.kv.state_pool.num_blocks == 3
    fill_nan(engine)
    depths = recorded_hits(engine)
    base = prompts_for([24], seed=14)[0]
    other = prompts_for([24], seed=15)[0]
    prompts = [base + [7], base + [8], other + [9], base + [10]]
    assert one_by_one(engine, prompts) == reference(model, prompts, MAX_NEW)
    # the second hits the first's deepest checkpoint (24); the third evicts it; the fourth then
    # finds no checkpoint of that prefix left
    assert depths == [0, 24, 0, 0]
    assert engine.kv.state_pool.num_cached_blocks == 1


def test_preemption_with_caching_stays_exact(models):
    model = models["granitemoehybrid"]
    prompts = [p + t for p, t in zip(prompts_for([30] * 4, seed=16), prompts_for([2, 3, 4, 5], seed=17))]
    prompts[2][:24] = prompts[0][:24]
    engine = make_engine(model, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64)
    fill_nan(engine)
    assert engine.generate(prompts, 8) == reference(model, prompts, 8)
    assert engine.stats().preemptions > 0


def test_elastic_growth_with_caching_stays_exact(models):
    model = models["falcon_h1"]
    prompts = shared_prompts()
    engine = make_engine(model, num_blocks=6, max_num_blocks=40)
    fill_nan(engine)
    assert engine.generate(prompts, MAX_NEW) == reference(model, prompts, MAX_NEW)
    assert engine.stats().prefix_cache_hits > 0 and engine.stats().preemptions == 0


@pytest.mark.skipif(not INTERPRETED, reason="kvcore-triton runs CPU tensors through the interpreter only")
def test_triton_mixer_kernels_with_caching(models):
    from kvcore_triton.mixers import TritonMixerBackend

    model = models["bamba"]
    prompts = shared_prompts()
    engine = make_engine(model, mixer_backend="triton-mixer")
    passed, varlen = [], []  # NOTE: checkpoints per row of each call that wrote some (and varlen rows' lengths)

    def counting(layer, hidden_states, states, slot_ids, checkpoints):
        passed.append([len(row) for row in checkpoints])
        return TritonMixerBackend.prefill_checkpoints(layer, hidden_states, states, slot_ids, checkpoints)

    def counting_varlen(layer, hidden_states, states, slot_ids, lengths, checkpoints=None):
        if checkpoints:
            passed.append([len(row) for row in checkpoints])
            varlen.append(list(lengths))
        return TritonMixerBackend.prefill_varlen(layer, hidden_states, states, slot_ids, lengths, checkpoints)

    for mixer in engine.mixers.layers.values():
        mixer.backend = type("Counting", (TritonMixerBackend,), {"prefill_checkpoints": staticmethod(counting),
                                                                 "prefill_varlen": staticmethod(counting_varlen)})
    fill_nan(engine)
    assert engine.generate(prompts, MAX_NEW) == reference(model, prompts, MAX_NEW)
    assert engine.stats().prefix_cache_hit_tokens >= 32
    assert max(max(rows) for rows in passed) >= 2  # NOTE: one call wrote several checkpoints of a chunk
    # NOTE: chunks of different lengths that pass checkpoints share one call too
    assert varlen and all(len(set(lengths)) > 1 for lengths in varlen)
