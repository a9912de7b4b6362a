"""Mixer backends: registered and chosen like attention backends, called once per mixer layer per
decode step for the whole batch, and exact (float32 tokens equal ``model.generate``) through the
torch reference and kvcore-triton's kernels (the Triton interpreter on CPU), with chunked prefill,
preemption, more sequences than slots, padded CUDA-graph steps and both state-page plans."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

import kvcore  # noqa: E402
from kvcore import MambaSpec, MixerBackend, select_backend  # noqa: E402
from kvcore.errors import KernelRequirementError, PluginError  # noqa: E402
from kvcore.hf import Engine, specs_from_config  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore.hf.step import DecodeGraphs  # noqa: E402
from kvcore.plugins import default_plugin_manager, reset_default_plugin_manager  # noqa: E402
from kvcore.plugins.registry import get_backends  # noqa: E402
from kvcore_torch import TorchMixerBackend  # noqa: E402
from kvcore_triton._checks import INTERPRETED  # noqa: E402

KERNEL_ARCHS = ["bamba", "granitemoehybrid", "granitemoehybrid-dense", "falcon_h1", "nemotron_h", "lfm2"]
#: kvcore-triton's kernels on the CPU models of these tests: through the interpreter only.
interpreted = pytest.mark.skipif(not INTERPRETED, reason="kvcore-triton runs CPU tensors through the interpreter only")
PROMPT_LENS = [9, 30, 1, 21]
MAX_NEW = 5


def fill_stale(engine, seed=11):
    view = next(iter(engine.kv.kv_caches.values()))
    raw = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    raw.view(torch.float32).copy_(torch.randn(raw.numel() // 4, generator=torch.Generator().manual_seed(seed)))


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(model_config(arch), seed=2) for arch in [*KERNEL_ARCHS, "qwen3_next"]}


@pytest.fixture(scope="module")
def references(models):
    prompts = prompts_for(PROMPT_LENS, seed=8)
    return prompts, {arch: reference(m, prompts, MAX_NEW) for arch, m in models.items()}


class CountingMixer(MixerBackend):
    """A third party's mixer library: the torch reference's maths, with every call recorded."""

    name = "counting-mixer"
    mamba_types = ("mamba2", "short_conv")
    calls: list[tuple[str, torch.nn.Module, int]] = []

    @staticmethod
    def decode(layer, hidden_states, states, slot_ids):
        CountingMixer.calls.append(("decode", layer, hidden_states.shape[0]))
        return TorchMixerBackend.decode(layer, hidden_states, states, slot_ids)

    @staticmethod
    def prefill(layer, hidden_states, states, slot_id):
        CountingMixer.calls.append(("prefill", layer, hidden_states.shape[0]))
        return TorchMixerBackend.prefill(layer, hidden_states, states, slot_id)


class CountingPlugin:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(CountingMixer)

    @kvcore.hookimpl
    def kvcore_backend_priority(self, backend, spec, device):
        return 50 if backend is CountingMixer else None


@pytest.fixture
def counting_default_manager(own_plugins):  # NOTE: this repository's plugins and the counting one, no other
    reset_default_plugin_manager()
    default_plugin_manager().register(CountingPlugin(), name="counting-mixers")
    CountingMixer.calls.clear()
    yield
    reset_default_plugin_manager()


def test_a_third_party_mixer_is_chosen_by_auto_and_called_once_per_layer_per_decode_step(
    models, references, counting_default_manager
):
    prompts, expected = references
    engine = Engine(models["bamba"], num_blocks=14, max_num_seqs=3, max_num_batched_tokens=16)
    assert {b.name for b in engine.kv.mixer_backends.values()} == {"counting-mixer"}
    decoding, marks = [], []
    schedule, step = engine.scheduler.schedule, engine._step

    def recording_schedule():
        batch = schedule()
        decoding.append(sum(r.num_new_tokens == 1 for r, _ in batch))
        return batch

    def marked_step():
        marks.append(len(CountingMixer.calls))
        step()

    engine.scheduler.schedule, engine._step = recording_schedule, marked_step
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == expected["bamba"]
    mixers = list(engine.mixers.layers.values())
    marks.append(len(CountingMixer.calls))
    assert sum(decoding) > len(prompts)  # NOTE: steps with several sequences decoding
    for rows, (start, end) in zip(decoding, zip(marks, marks[1:])):
        calls = [c for c in CountingMixer.calls[start:end] if c[0] == "decode"]
        assert [(c[1], c[2]) for c in calls] == ([(m.module, rows) for m in mixers] if rows else [])
    prefills = [c for c in CountingMixer.calls if c[0] == "prefill"]
    assert sum(n for _, _, n in prefills) == len(mixers) * sum(p for p in PROMPT_LENS if p > 1)


def test_select_backend_picks_mixer_backends_by_mamba_type_on_a_fresh_manager():
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(CountingPlugin(), name="counting-mixers")
    conv = MambaSpec(16, [(8, 4)], [torch.float32], mamba_type="short_conv")
    assert select_backend(conv, "cpu", plugin_manager=pm) is CountingMixer
    gdn = MambaSpec(16, [(8, 4)], [torch.float32], mamba_type="gated_delta_net")
    with pytest.raises(ValueError, match=r"no registered mixer backend can serve .*counting-mixer: runs mixers "
                                         r"\['mamba2', 'short_conv'\], not 'gated_delta_net' \(rule: mamba_types\)"):
        select_backend(gdn, "cpu", plugin_manager=pm)
    with pytest.raises(ValueError, match="no registered attention backend"):
        select_backend(kvcore.FullAttentionSpec(16, 2, 16, torch.float32), "cpu", plugin_manager=pm)


def test_installed_plugins_serve_every_mamba_type_and_triton_wins_on_cuda(own_plugins):
    for kind in ("mamba2", "short_conv", "gated_delta_net"):
        spec = MambaSpec(16, [(8, 4)], [torch.float32], mamba_type=kind)
        assert select_backend(spec, "cpu").name == "torch-mixer"
        assert select_backend(spec, "cuda").name == ("torch-mixer" if kind == "gated_delta_net" else "triton-mixer")
    untyped = MambaSpec(16, [(8, 4)], [torch.float32])
    with pytest.raises(ValueError, match="not None"):
        select_backend(untyped, "cpu")


@pytest.mark.parametrize(
    "attributes, problem",
    [({"mamba_types": ()}, "mamba_types=()"), ({"mamba_types": "mamba2"}, "mamba_types='mamba2'"),
     ({"decode": None}, "does not implement decode"), ({"prefill": None}, "does not implement prefill")],
)
def test_register_checks_the_mixer_protocol(attributes, problem):
    namespace = {"name": "bad-mixer", "mamba_types": ("mamba2",), "decode": staticmethod(lambda *a: None),
                 "prefill": staticmethod(lambda *a: None), **attributes}
    for method in ("decode", "prefill"):
        if namespace[method] is None:
            del namespace[method]
    bad = type("BadMixer", (MixerBackend,), namespace)

    class Plugin:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(bad)

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(Plugin(), name="bad-plugin")
    with pytest.raises(PluginError, match=f"bad-plugin.*{problem}.*kvcore_register_backends"):
        get_backends(pm)


@interpreted
@pytest.mark.parametrize("arch", KERNEL_ARCHS)
def test_triton_mixer_kernels_give_model_generate_tokens(models, references, arch):
    prompts, expected = references
    engine = Engine(models[arch], num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16,
                    mixer_backend="triton-mixer")
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == expected[arch]
    assert engine.stats().steps > max(PROMPT_LENS) // 16 + MAX_NEW  # NOTE: chunked prefill beside decodes


@interpreted
def test_triton_mixer_refuses_a_gated_delta_net_by_name(models):
    with pytest.raises(KernelRequirementError, match=r"triton-mixer.*not 'gated_delta_net' \(rule: mamba_types\)"):
        Engine(models["qwen3_next"], num_blocks=12, mixer_backend="triton-mixer")


@interpreted
@pytest.mark.parametrize("separate", [True, False])
def test_preemption_and_more_sequences_than_slots_through_the_kernels(models, separate):
    model = models["granitemoehybrid"]
    prompts = prompts_for([30, 28, 26, 24, 5], seed=3)
    engine = Engine(model, num_blocks=9, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                    mixer_backend="triton-mixer", separate_state_pages=separate)
    fill_stale(engine)
    assert engine.generate(prompts, 8) == reference(model, prompts, 8)
    assert engine.stats().preemptions > 0


@pytest.mark.parametrize("arch", ["nemotron_h", "lfm2", "qwen3_next"])
def test_padded_cuda_graph_decode_steps_are_exact(models, references, arch):
    # The steps a CUDA graph replays (padded to a bucket, padding rows on the null state slot),
    # run eagerly so that CPU tests cover them.
    prompts, expected = references
    engine = Engine(models[arch], num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64)
    engine.graphs = DecodeGraphs(engine.device, 4, capture=False)
    buckets, bucket = [], engine.graphs.bucket
    engine.graphs.bucket = lambda n: buckets.append((n, bucket(n))) or bucket(n)
    fill_stale(engine)
    assert engine.generate(prompts[:3], MAX_NEW) == expected[arch][:3]  # NOTE: 3 rows in the bucket of 4
    assert engine.stats().graph_steps > 0 and any(n < size for n, size in buckets)


@pytest.mark.parametrize("lens, adjacent", [([12, 12, 12, 5], True), ([12, 5, 12, 12], False)])
def test_equal_length_chunks_prefill_as_one_batch_and_stay_exact(models, lens, adjacent):
    # NOTE: chunks back to back in the packed row go in (and come out) as a view of it; others are gathered
    model = models["bamba"]
    prompts = prompts_for(lens, seed=6)
    calls = []
    original = TorchMixerBackend.prefill_batch

    def counting(layer, hidden_states, states, slot_ids):
        calls.append(tuple(hidden_states.shape[:2]))
        # NOTE: a view shares the whole packed row's storage; a gathered batch has its own
        shares = hidden_states.untyped_storage().nbytes() > hidden_states.numel() * hidden_states.element_size()
        assert shares == adjacent
        return original(layer, hidden_states, states, slot_ids)

    engine = Engine(model, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    mixer = engine.mixers.layers[next(iter(engine.mixers.layers))]
    mixer.backend = type("Counting", (TorchMixerBackend,), {"prefill_batch": staticmethod(counting)})
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == reference(model, prompts, MAX_NEW)
    assert calls == [(3, 12)]


@interpreted
@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])  # NOTE: NemotronH clamps its step sizes (min 0.001)
@pytest.mark.parametrize("lens, calls", [([12, 5, 9, 3], [[12, 5, 9, 3]]), ([12, 20, 9, 1], [[12, 9]])])
def test_chunks_of_different_lengths_prefill_in_one_call_and_stay_exact(models, arch, lens, calls):
    # NOTE: chunks up to the same number of 16-token scan chunks share a call, right-padded; the
    # 20-token chunk (two scan chunks) and the 1-token one do not, which leaves [12, 9] apart in the row
    from kvcore_triton import TritonMixerBackend

    model = models[arch]
    prompts = prompts_for(lens, seed=9)
    seen, original = [], TritonMixerBackend.prefill_varlen.__func__

    # NOTE: an override without the checkpoints argument still serves steps that keep none
    def counting(cls, layer, hidden_states, states, slot_ids, lengths):
        seen.append(list(lengths))
        return original(cls, layer, hidden_states, states, slot_ids, lengths)

    engine = Engine(model, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64, mixer_backend="triton-mixer")
    mixer = engine.mixers.layers[next(iter(engine.mixers.layers))]
    assert mixer.varlen
    mixer.backend = type("Counting", (TritonMixerBackend,), {"prefill_varlen": classmethod(counting)})
    fill_stale(engine)
    assert engine.generate(prompts, MAX_NEW) == reference(model, prompts, MAX_NEW)
    assert seen == calls


def bamba_mixer_inputs(models, seed, slots, tokens):
    """A Bamba mixer module, random states of ``slots`` slots (and two copies) and 3 rows of input."""
    module = next(m for m in models["bamba"].modules() if hasattr(m, "A_log"))
    spec = next(s for s in specs_from_config(models["bamba"].config).values() if isinstance(s, MambaSpec))
    gen = torch.Generator().manual_seed(seed)
    states = [torch.randn(slots, *shape, generator=gen) for shape in spec.shapes]
    x = torch.randn(3, tokens, module.hidden_size, generator=gen)
    return module, states, x, [s.clone() for s in states], [s.clone() for s in states]


def test_the_default_varlen_prefill_runs_each_length_as_its_own_batch(models):
    module, _, x, got, want = bamba_mixer_inputs(models, 4, 6, 7)
    seen = []
    counting = type("Counting", (TorchMixerBackend,), {"prefill_batch": classmethod(
        lambda cls, layer, h, st, slots: seen.append(tuple(h.shape[:2])) or TorchMixerBackend.prefill_batch(
            layer, h, st, slots))})
    with torch.inference_mode():
        out = counting.prefill_varlen(module, x, got, [5, 1, 3], [7, 4, 7])
        refs = [TorchMixerBackend.prefill(module, row[:n], want, slot) for row, n, slot in zip(x, [7, 4, 7], [5, 1, 3])]
    assert seen == [(2, 7)]  # NOTE: the 4-token row alone, through prefill
    for row, ref, n in zip(out, refs, [7, 4, 7]):
        torch.testing.assert_close(row[:n], ref)
    assert not out[1, 4:].any()
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs)


def test_the_default_varlen_prefill_keeps_checkpoints_through_prefill_checkpoints(models):
    module, states, x, got, want = bamba_mixer_inputs(models, 5, 8, 9)
    lengths, cuts = [9, 4, 9], [[(3, 6)], [], [(9, 7)]]
    seen = []
    counting = type("Counting", (TorchMixerBackend,), {"prefill_checkpoints": classmethod(
        lambda cls, layer, h, st, slots, cps: seen.append((tuple(h.shape[:2]), list(cps)))
        or TorchMixerBackend.prefill_checkpoints(layer, h, st, slots, cps))})
    with torch.inference_mode():
        out = counting.prefill_varlen(module, x, got, [5, 1, 3], lengths, cuts)
        refs = [TorchMixerBackend.prefill_checkpoints(module, row[None, :n], want, [slot], [kept])[0]
                for row, n, slot, kept in zip(x, lengths, [5, 1, 3], cuts)]
    assert seen == [((2, 9), [[(3, 6)], [(9, 7)]])]  # NOTE: the 4-token row has none: plain prefill
    for row, ref, n in zip(out, refs, lengths):
        torch.testing.assert_close(row[:n], ref)
    for mine, theirs, before in zip(got, want, states):
        torch.testing.assert_close(mine, theirs)
        assert not torch.equal(mine[[6, 7]], before[[6, 7]])


def test_the_hybrid_default_block_is_the_attention_backends_not_grown_for_states():
    # NOTE: a Granite-4.0-H-like state page (64 heads of 64 x 128 float32) is ~2 MiB, thousands of
    # tokens of attention; with separate state pages the attention block stays the backend's.
    config = model_config("granitemoehybrid", mamba_n_heads=64, mamba_d_head=64, mamba_d_state=128,
                          hidden_size=2048, num_hidden_layers=2, layer_types=["mamba", "attention"])
    specs = specs_from_config(config)
    state = next(s for s in specs.values() if isinstance(s, MambaSpec))
    assert state.real_page_size_bytes > 2 << 20
    from kvcore.hf.engine import resolve_defaults

    make = lambda size: specs_from_config(config, block_size=size)  # noqa: E731
    assert resolve_defaults(make, torch.device("cpu"), "auto", None, None).block_size == 16
    assert resolve_defaults(make, torch.device("cpu"), "auto", None, None, unified_states=True).block_size > 256
    engine = Engine(random_model(model_config("granitemoehybrid", mamba_d_state=64, mamba_n_heads=8)),
                    num_blocks=8, max_num_seqs=2)
    attention = next(g for g in engine.kv.config.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec))
    assert attention.kv_cache_spec.block_size == 16 and engine.kv.config.separate_state_pages


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "lfm2", "qwen3_next"])
@pytest.mark.parametrize("caching", [False, True])
def test_gpu_defaults_serve_hybrids_exactly_with_kernels_and_cuda_graphs(arch, caching, monkeypatch):
    # NOTE: cuDNN's TF32 convolutions (transformers' reference prefill) round by call shape: off for equality.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = random_model(model_config(arch), seed=2, device="cuda")
    common = prompts_for([40], seed=21)[0]
    prompts = [common[: 8 * k] + p for k, p in zip([5, 5, 2, 0, 4, 3], prompts_for([9, 30, 1, 21, 6, 13], seed=22))]
    want = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                    enable_prefix_caching=caching)
    expected = {"triton-mixer"} if arch != "qwen3_next" else {"torch-mixer"}
    assert {b.name for b in engine.kv.mixer_backends.values()} == expected
    assert (engine.graphs is not None) == (arch != "qwen3_next")
    assert [engine.generate([p], 8)[0] for p in prompts[:2]] + engine.generate(prompts[2:], 8) == want
    assert engine.stats().graph_steps > 0 or engine.graphs is None
    assert (engine.stats().prefix_cache_hit_tokens > 0) == caching
