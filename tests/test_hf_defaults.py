"""kvcore.hf.Engine's defaults: "auto" per layer, the backend's block size, the step budget by device."""

from __future__ import annotations

import pytest
import torch

from kvcore.hf.engine import BATCHED_TOKENS, BLOCK_SIZE
from kvcore.hf.engine import resolve_defaults as resolve
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec

pytest.importorskip("kvcore_triton")

# NOTE: what "auto" picks depends on the backends installed: only this repository's load.
pytestmark = pytest.mark.usefixtures("own_plugins")


def _specs(size):
    return {
        "l0": FullAttentionSpec(size, 2, 64, torch.bfloat16),
        "l1": SlidingWindowSpec(size, 2, 64, torch.bfloat16, sliding_window=32),
    }


def test_cpu_auto_keeps_todays_defaults():
    got = resolve(_specs, torch.device("cpu"), "auto", None, None)
    assert (got.block_size, got.max_num_batched_tokens) == (BLOCK_SIZE, BATCHED_TOKENS["cpu"]) == (16, 2048)
    assert {b.name for b in got.layer_backends.values()} == {"torch"}


def test_cuda_auto_takes_the_preferred_backend_and_its_block_size():
    # Asked about a CUDA device without one: requirements and priorities only.
    got = resolve(_specs, torch.device("cuda"), "auto", None, None)
    assert {b.name for b in got.layer_backends.values()} == {"triton"}
    assert got.block_size == 64 and got.max_num_batched_tokens == 4096


def test_explicit_values_win():
    got = resolve(_specs, torch.device("cuda"), "flashinfer", 32, 512)
    assert (got.block_size, got.max_num_batched_tokens) == (32, 512)
    assert set(got.layer_backends.values()) == {"flashinfer"}
    # FlashInfer takes any page size and states no preference: 16.
    assert resolve(_specs, torch.device("cuda"), "flashinfer", None, None).block_size == 16


def test_warm_up_captures_every_missing_size_once(monkeypatch):
    from kvcore.hf.step import DecodeGraphs

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, the KV cache is on cpu"):
        DecodeGraphs(torch.device("cpu"), 5)
    graphs = DecodeGraphs(torch.device("cpu"), 5, capture=False)
    graphs.graphs[2] = object()
    captured = []
    monkeypatch.setattr(graphs, "capture_size", lambda size, forward: captured.append((size, forward())))

    class Steps:  # stages the padding-only step of a size
        def build(self, batch, *, pad_to):
            assert batch == []
            return pad_to

    graphs.capture_all(Steps(), lambda step: -step, progress=False)
    assert graphs.sizes == [1, 2, 4, 5] and captured == [(1, -1), (4, -4), (5, -5)]


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_captures_every_decode_graph_when_built():
    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config("llama"), dtype=torch.bfloat16, device="cuda", seed=1)
    engine = Engine(model, num_blocks=64, max_num_seqs=20)
    assert engine.kv.group_of("model.layers.0.self_attn").backend.get_name() == "triton"
    assert engine.graphs is not None and sorted(engine.graphs.graphs) == engine.graphs.sizes == [1, 2, 4, 8, 16, 20]
    before = dict(engine.graphs.graphs)
    engine.generate([[5, 6, 7], [8, 9]], 4)
    assert engine.graphs.graphs == before and engine.stats().graph_steps > 0  # nothing captured lazily


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_the_first_generate_compiles_no_kernel_the_build_did_not(arch, monkeypatch):
    import triton
    from _hf_reference import prompts_for

    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if not hasattr(knobs, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    model = random_model(model_config(arch), dtype=torch.bfloat16, device="cuda", seed=3)
    model.generation_config.eos_token_id = None
    engine = Engine(model, num_blocks=256, max_num_seqs=8)
    compiled = []
    monkeypatch.setattr(knobs, "jit_post_compile_hook", lambda *a, **kw: compiled.append(kw.get("repr")) and False)
    outputs = engine.generate(prompts_for([40, 3, 97, 17, 5, 64, 33, 9, 120], seed=8), 6)  # NOTE: more than 8
    assert compiled == [] and [len(o) for o in outputs] == [6] * 9


def test_a_step_that_cannot_be_captured_runs_eagerly_unless_graphs_were_asked_for():
    from kvcore.errors import KVCoreError
    from kvcore.hf.step import uncapturable

    exc = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture\nmore")
    with pytest.warns(RuntimeWarning, match=r"without CUDA graphs: .* \(Cannot copy between CPU and CUDA tensors "
                                            r"during CUDA graph capture\)$"):
        assert uncapturable(exc, asked=False) is None
    with pytest.raises(KVCoreError, match=r"cuda_graphs=True, but .*\(Cannot copy .*\); pass cuda_graphs=False"):
        uncapturable(exc, asked=True)


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_moe_hybrid_whose_step_cannot_be_captured_serves_eagerly():
    # NOTE: transformers' grouped-GEMM experts copy from unpinned host memory inside the forward
    from _hf_reference import prompts_for

    from kvcore.errors import KVCoreError
    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config("granitemoehybrid"), dtype=torch.bfloat16, device="cuda", seed=2)
    model.generation_config.eos_token_id = None
    prompts = prompts_for([7, 12, 3], seed=5)
    options = dict(num_blocks=64, max_num_seqs=4, mixer_backend="triton-mixer")
    engine = Engine(model, **options)  # NOTE: the default cuda_graphs never refuses a model it cannot capture
    if engine.graphs is None:  # NOTE: this transformers' experts cannot be captured
        with pytest.raises(KVCoreError, match="pass cuda_graphs=False"):
            Engine(model, **options, cuda_graphs=True)
    outputs = engine.generate(prompts, 5)
    assert outputs == Engine(model, **options, cuda_graphs=False).generate(prompts, 5)
    assert [len(o) for o in outputs] == [5, 5, 5]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_warm_prefill_compiles_without_touching_the_cache(arch):
    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config(arch), seed=1)
    engine = Engine(model, num_blocks=3, block_size=4)  # a pool of 12 tokens: shorter than the warm-up
    for view in engine.kv.layer_kv_caches.values():
        view.normal_()  # random bytes: the warm-up must write none of them
    before = {name: view.clone() for name, view in engine.kv.layer_kv_caches.items()}
    engine._warm_prefill(num_tokens=20)
    assert all(torch.equal(before[n], v) for n, v in engine.kv.layer_kv_caches.items())
    assert engine.stats().steps == 0


def test_a_default_engine_runs_256_requests_at_once():
    from _hf_reference import prompts_for

    from kvcore.hf import Engine
    from kvcore.hf.models import model_config, random_model

    model = random_model(model_config("llama", num_hidden_layers=1, vocab_size=256), seed=2)
    engine = Engine(model, num_blocks=300)  # the default max_num_seqs (64 used to leave 136 waiting)
    outputs = engine.generate(prompts_for([3] * 200, seed=3), 2)
    assert [len(o) for o in outputs] == [2] * 200
    assert engine.stats().steps == 2  # every prompt prefilled in the first step, decoded in the second


def _hybrid_specs(size, heads=128):
    from kvcore.specs import MambaSpec

    # conv state 768 bytes + recurrent state 8 x 16 x heads float32: 66,304 bytes at 128, 8,960 at 16
    state = MambaSpec(size, shapes=((96, 4), (8, 16, heads)), dtypes=(torch.bfloat16, torch.float32))
    return {"mixer0": state, "attn1": FullAttentionSpec(size, 2, 64, torch.bfloat16), "mixer2": state}


def test_a_hybrids_attention_blocks_grow_until_their_page_holds_a_state_page():
    from kvcore.memory.layout import KVCacheLayout
    from kvcore.memory.planner import plan_kv_cache

    got = resolve(_hybrid_specs, torch.device("cpu"), "auto", None, None, unified_states=True)
    state_page = got.specs["mixer0"].real_page_size_bytes
    attention_page = got.specs["attn1"].real_page_size_bytes
    assert got.block_size % BLOCK_SIZE == 0 and got.block_size > BLOCK_SIZE
    # the smallest multiple of the preferred block whose page holds a whole state page
    assert attention_page >= state_page > attention_page * (got.block_size - BLOCK_SIZE) // got.block_size
    budget = 64 << 20
    grown = plan_kv_cache(got.specs, KVCacheLayout.LBNHC, available_memory=budget)
    padded = plan_kv_cache(_hybrid_specs(BLOCK_SIZE), KVCacheLayout.LBNHC, available_memory=budget)
    # padding 16-token attention pages up to a state page holds several times fewer tokens
    assert grown.token_capacity >= 4 * padded.token_capacity
    # an explicit block size is the user's choice and is kept
    assert resolve(_hybrid_specs, torch.device("cpu"), "auto", 16, None).block_size == 16
    # a state page under two attention pages (8,960 against 8,192 bytes): padding attention is cheaper
    assert resolve(lambda size: _hybrid_specs(size, 16), torch.device("cpu"), "auto", None, None,
                   unified_states=True).block_size == 16


def test_auto_is_asked_once_per_distinct_spec_so_every_layer_of_it_gets_one_backend(monkeypatch):
    """A plugin whose priority changes from call to call cannot split one spec's layers."""
    import kvcore
    from kvcore.plugins import registry
    from kvcore_torch import TorchAttentionBackend
    from kvcore_torch import plugin as torch_plugin

    fickle = type("Fickle", (TorchAttentionBackend,), {"name": "fickle"})

    class Fickle:
        calls = 0

        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(fickle)

        @kvcore.hookimpl
        def kvcore_backend_priority(self, backend, spec, device):
            if backend is fickle:
                Fickle.calls += 1
                return 10 if Fickle.calls % 2 else -10

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(torch_plugin, name="torch")
    pm.register(Fickle(), name="fickle")
    monkeypatch.setattr(registry, "default_plugin_manager", lambda: pm)
    specs = lambda size: {f"l{i}": FullAttentionSpec(size, 2, 64, torch.bfloat16) for i in range(6)}  # noqa: E731
    got = resolve(specs, torch.device("cpu"), "auto", None, None)
    assert set(got.layer_backends.values()) == {fickle} and Fickle.calls == 1
