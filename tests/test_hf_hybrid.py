"""Hybrid models (attention plus Mamba2 / short-convolution mixers) served from kvcore's state caches.

Every supported architecture's tiny random float32 model serves prompts of
mixed lengths with a token budget that splits prompts into chunks, more
prompts than ``max_num_seqs``, and a pool full of stale random bytes; the
tokens must equal ``model.generate`` on each prompt alone. Without the zeroing
of new state slots the same run goes wrong, and the engine's logits match the
model's own to float precision.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

from kvcore import FullAttentionSpec, MambaSpec  # noqa: E402
from kvcore.hf import Engine, specs_from_config  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

HYBRIDS = ["bamba", "granitemoehybrid", "granitemoehybrid-dense", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next"]
PROMPT_LENS = [5, 40, 17, 1, 33, 26]
MAX_NEW = 6


def fill_stale(engine, seed=7):
    """Random float32 garbage in every byte of the cache (a pool that served other requests)."""
    view = next(iter(engine.kv.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    raw.view(torch.float32).copy_(torch.randn(raw.numel() // 4, generator=torch.Generator().manual_seed(seed)))


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(model_config(arch), seed=1) for arch in HYBRIDS}


@pytest.fixture(scope="module")
def references(models):
    prompts = prompts_for(PROMPT_LENS)
    return prompts, {arch: reference(m, prompts, MAX_NEW) for arch, m in models.items()}


def make_engine(model, **kwargs):
    return Engine(model, **{"num_blocks": 14, "max_num_seqs": 3, "max_num_batched_tokens": 16, **kwargs})


@pytest.mark.parametrize("arch", HYBRIDS)
def test_tokens_equal_model_generate_with_chunks_waiting_and_stale_slots(models, references, arch):
    prompts, expected = references
    engine = make_engine(models[arch])
    groups = engine.kv.config.kv_cache_groups
    state = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert state and any(isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups)
    assert {n for g in state for n in g.layer_names} == {n for n, s in specs_from_config(models[arch].config).items()
                                                          if isinstance(s, MambaSpec)}
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == expected[arch]
    stats = engine.stats()
    assert stats.requests_finished == len(prompts)
    assert stats.blocks_zeroed == stats.blocks_allocated
    assert engine.kv.block_pool.num_free_blocks == engine.kv.num_blocks - 1
    # NOTE: 40 tokens through a 16-token budget: prompts were prefilled in chunks beside decodes.
    assert stats.steps > max(PROMPT_LENS) // 16 + MAX_NEW
    assert "forward" not in vars(engine.mixers.layers[state[0].layer_names[0]].module)  # restored


@pytest.mark.parametrize("arch", ["bamba", "lfm2", "qwen3_next"])
def test_the_unified_plan_is_exact_too(models, references, arch):
    prompts, expected = references
    engine = make_engine(models[arch], separate_state_pages=False)
    assert not engine.kv.config.separate_state_pages and engine.kv.state_pool is None
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == expected[arch]


@pytest.mark.parametrize("separate", [True, False])
def test_zeroing_new_state_slots_is_load_bearing(models, references, monkeypatch, separate):
    prompts, expected = references
    engine = make_engine(models["bamba"], separate_state_pages=separate)
    fill_stale(engine)
    # NOTE: separate state pages have a zeroer of their own; switching it off alone diverges.
    zeroer = engine.kv.state_zeroer if separate else engine.kv.zeroer
    monkeypatch.setattr(zeroer, "zero_block_ids", lambda ids: None)
    assert engine.generate(prompts, MAX_NEW) != expected["bamba"]


def test_a_preempted_sequence_restarts_from_a_fresh_slot(models):
    model = models["granitemoehybrid"]
    prompts = prompts_for([30, 28, 26, 24], seed=3)
    engine = make_engine(model, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    fill_stale(engine)
    assert engine.generate(prompts, 10) == reference(model, prompts, 10)
    assert engine.stats().preemptions > 0


@pytest.mark.parametrize("arch", ["bamba", "lfm2"])
def test_logits_equal_the_models_own(models, arch, monkeypatch):
    model = models[arch]
    prompts = prompts_for([23, 9, 37], seed=5)
    engine = make_engine(model, max_num_batched_tokens=12)
    fill_stale(engine)
    seen = []
    logits_of = engine._logits

    def recording(inputs, metadata):
        logits = logits_of(inputs, metadata)
        seen.extend((r.req_id, r.num_tokens, row) for r, row in zip(inputs.sampled, logits.clone()))
        return logits

    monkeypatch.setattr(engine, "_logits", recording)
    outputs = engine.generate(prompts, 5)
    full = {i: torch.tensor([p + out]) for i, (p, out) in enumerate(zip(prompts, outputs))}
    with torch.no_grad():
        want = {i: model(ids).logits[0] for i, ids in full.items()}
    assert len(seen) == 5 * len(prompts)
    worst = max((row - want[rid][n - 1]).abs().max().item() for rid, n, row in seen)
    assert worst < 1e-3, worst


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_specs_are_the_states_transformers_keeps(models, arch, dtype):
    model = models[arch].to(dtype)
    try:
        specs = specs_from_config(model.config, dtype=dtype)
        with torch.no_grad():
            cache = model(torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True).past_key_values
    finally:
        model.to(torch.float32)
    mixers = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    assert mixers and all(n in dict(model.named_modules()) for n in specs)
    for name, spec in mixers.items():
        layer = cache.layers[int(name.split(".")[2])]
        kept = [layer.recurrent_states[0], layer.conv_states[0]] if len(spec.shapes) == 2 else [layer.conv_states[0]]
        assert [tuple(t.shape[1:]) for t in kept] == list(spec.shapes), name
        assert [t.dtype for t in kept] == list(spec.dtypes), name
    if len(next(iter(mixers.values())).shapes) == 2:
        assert next(iter(mixers.values())).dtypes[0] == torch.float32  # recurrent state stays float32


@pytest.mark.parametrize(
    "make, name, why",
    [
        (lambda: transformers.JambaConfig(), "Jamba", "prefilled in chunks"),
        (lambda: transformers.MiniMaxConfig(), "MiniMax", "own cache class"),
        (lambda: transformers.Zamba2Config(), "Zamba2", "share one attention module"),
    ],
)
def test_hybrids_kvcore_cannot_own_are_refused_by_name(make, name, why):
    config = make()
    with pytest.raises(ValueError, match=f"does not serve {name} hybrids .*{why}"):
        specs_from_config(config)
    model = torch.nn.Module()
    model.config = config
    with pytest.raises(ValueError, match=f"does not serve {name} hybrids"):
        Engine(model)


def test_prefix_caching_cuda_graphs_and_mixers_alone_are_refused(models):
    with pytest.raises(ValueError, match="prefix caching serves the hybrid 'lfm2' only with separate_state_pages"):
        make_engine(models["lfm2"], enable_prefix_caching=True, separate_state_pages=False)
    with pytest.raises(ValueError, match="CUDA graphs serve the hybrid 'lfm2' only with separate_state_pages"):
        make_engine(models["lfm2"], cuda_graphs=True, separate_state_pages=False)
    with pytest.raises(ValueError, match="mixer layers only"):
        make_engine(random_model(model_config("nemotron_h", hybrid_override_pattern="MM-M")))


def test_a_non_bool_cuda_graphs_is_a_type_error_even_for_a_hybrid(models):
    with pytest.raises(TypeError, match=r"cuda_graphs must be True, False or None, got 'x'"):
        make_engine(models["lfm2"], cuda_graphs="x")


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_state_groups_share_one_allocation_in_any_layout(models, references, layout):
    prompts, expected = references
    engine = make_engine(models["nemotron_h"], layout=layout)
    storages = {v.untyped_storage().data_ptr() for v in engine.kv.kv_caches.values()}
    assert len(storages) == 1 and engine.kv.layout.name == layout
    fill_stale(engine)
    assert engine.generate(prompts[:4], MAX_NEW) == expected["nemotron_h"][:4]


def test_mixers_read_and_write_the_caches_own_views(models):
    engine = make_engine(models["bamba"])
    for name, layer in engine.mixers.layers.items():
        base = engine.kv.layer_kv_caches[name].untyped_storage().data_ptr()
        assert [s.untyped_storage().data_ptr() for s in layer.states] == [base, base]


def test_the_gpu_warm_up_pass_leaves_every_state_slot_untouched(models, references):
    prompts, expected = references
    engine = make_engine(models["bamba"])
    fill_stale(engine)
    before = {n: v.clone() for n, v in engine.kv.kv_caches.items()}
    engine._warm_prefill()
    assert all(torch.equal(v, before[n]) for n, v in engine.kv.kv_caches.items())
    assert engine.mixers.step is None
    assert engine.generate(prompts, MAX_NEW) == expected["bamba"]


def test_a_mixer_bound_to_an_attention_group_is_an_internal_error_naming_it():
    from _transfer_caches import cached_cache

    from kvcore.hf.mixers import MixerRunner

    kv = cached_cache("uniform", "LBNHC")
    name = next(iter(kv.kv_caches))
    with pytest.raises(RuntimeError, match=rf"mixer {name} is in a FullAttentionSpec group"):
        MixerRunner(kv, {name: torch.nn.Identity()})
