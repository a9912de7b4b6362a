"""kvcore-triton compiles a handful of kernel variants, all of them while the engine is built.

Triton compiles a kernel once per specialization key: its constexprs and, for every other
argument, its type, whether an int is 1 or a multiple of 16, whether a pointer is 16-byte aligned.
A step's index tensors sit at step-dependent offsets of one packed buffer, so keys used to vary
with the step's size and the first ``generate`` compiled new variants. The kernels now take one
key per layer kind whatever the step, and the engine's warm-up compiles exactly those.
"""

from __future__ import annotations

import collections
import inspect

import pytest
import torch

pytest.importorskip("transformers")
triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvcore_triton.prefill import _varlen_kernel  # noqa: E402

#: Kernels whose variants a step's size must not multiply.
STEP_KERNELS = ("_varlen_kernel", "_store_kv_kernel", "_decode_split_kernel")


def _model(arch="gemma3"):
    from kvcore.hf.models import model_config, random_model

    return random_model(model_config(arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
                        seed=1)


def _key(kernel, args, kwargs):
    """The key Triton's JIT would compile this launch under (its own specialization function)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    options = kernel.kwargs
    plain = set(options.get("do_not_specialize") or ())
    unaligned = set(options.get("do_not_specialize_on_alignment") or ())
    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = {**dict(zip((p.name for p in params), args)), **kwargs}
    key = []
    for p in params:
        value = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            key.append((p.name, repr(value)))
        else:
            key.append((p.name, native_specialize_impl(BaseBackend, value, False, p.name not in plain,
                                                       p.name not in unaligned)))
    return tuple(key) + tuple(sorted((k, v) for k, v in kwargs.items() if k.startswith("num_")))


@pytest.fixture
def launches(monkeypatch):
    """Every interpreted launch's specialization key, by kernel name."""
    if not isinstance(_varlen_kernel, InterpretedFunction):
        pytest.skip("counts keys of interpreted launches (TRITON_INTERPRET=1)")
    seen: dict[str, list] = collections.defaultdict(list)
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        seen[self.fn.__name__].append(_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    return seen


def test_steps_of_any_size_launch_the_variants_the_warm_up_compiled(launches):
    from kvcore.hf import Engine

    # Gemma 3: a sliding-window group and a full group; chunked prefill, waiting requests, decodes.
    engine = Engine(_model(), backend="triton", num_blocks=160, max_num_seqs=3, max_num_batched_tokens=40)
    engine._warm_prefill()  # what Engine.warmup runs on a GPU
    warmed = {name: set(keys) for name, keys in launches.items()}
    assert set(warmed) >= set(STEP_KERNELS)
    gen = torch.Generator().manual_seed(0)
    for count in (1, 2, 4, 5):
        lengths = torch.randint(1, 120, (count,), generator=gen).tolist()
        engine.generate([torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths], 3)
    for name in STEP_KERNELS:
        keys = set(launches[name])
        assert len(launches[name]) > 4 * len(keys)  # many launches of many step sizes ...
        assert keys <= warmed[name], f"{name}: a step launched a variant the warm-up did not compile"
        assert len(keys) <= 2  # ... and one variant per window kind (sliding, full)


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engines_first_generate_compiles_nothing():
    from kvcore.hf import Engine
    from kvcore_triton.decode import _decode_merge_kernel, _decode_split_kernel
    from kvcore_triton.store import _store_kv_kernel

    kernels = (_varlen_kernel, _store_kv_kernel, _decode_split_kernel, _decode_merge_kernel)

    def compiled():
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    model = _model("llama").to(device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    before = compiled()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 7, 33, 100, 250, 3, 64)]
    engine.generate(prompts, 8)
    assert compiled() == before
