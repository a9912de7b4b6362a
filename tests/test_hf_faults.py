"""Faults inside an engine step, and requests the block-table rows must hold to the end.

When anything raises in a step (the backend's forward, zeroing in
``begin_step``, ``build_metadata``, a mixer, Ctrl-C), ``generate`` raises it
only after every queued request is dropped and every block it held is free:
the next ``generate`` serves only its own prompts, token for token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return random_model(model_config("llama"), seed=2)


@pytest.fixture(scope="module")
def bamba():
    return random_model(model_config("bamba"), seed=2)


def test_a_sliding_window_request_longer_than_the_pool_runs_to_the_end():
    model = random_model(model_config("mistral"), seed=4)  # window 24 on every layer
    prompt = prompts_for([120], seed=9)
    engine = Engine(model, num_blocks=8, max_num_batched_tokens=32)
    assert engine.generate(prompt, 20) == reference(model, prompt, 20)
    assert engine.stats().window_freed_blocks > 0
    assert engine.kv.block_pool.num_free_blocks == 7


def _fail_after(calls, error):
    """A stand-in that lets ``calls`` calls through ``real`` and then raises ``error``."""
    count = [0]

    def wrap(real):
        def failing(*args, **kwargs):
            count[0] += 1
            if count[0] > calls:
                raise error
            return real(*args, **kwargs)

        return failing

    return wrap


def _inject(engine, where, wrap, monkeypatch):
    if where == "forward":
        binding = next(iter(engine._layers.values()))
        monkeypatch.setattr(binding.backend, "forward", staticmethod(wrap(binding.backend.forward)))
    elif where == "begin_step":
        monkeypatch.setattr(engine.kv.zeroer, "zero_block_ids", wrap(engine.kv.zeroer.zero_block_ids))
    elif where == "build_metadata":
        monkeypatch.setattr(type(engine.kv), "build_metadata", wrap(type(engine.kv).build_metadata))
    else:  # a mixer: its module raises from a forward pre-hook
        module = next(iter(engine.mixers.layers.values())).module
        failing = wrap(lambda: None)
        handle = module.register_forward_pre_hook(lambda *_: failing())
        monkeypatch.setattr(engine, "_remove_test_hook", handle.remove, raising=False)


@pytest.mark.parametrize(
    "arch, where, error",
    [
        ("llama", "forward", RuntimeError("launch failed")),
        ("llama", "begin_step", KeyboardInterrupt()),
        ("llama", "build_metadata", RuntimeError("bad metadata")),
        ("bamba", "forward", KeyboardInterrupt()),
        ("bamba", "mixer", RuntimeError("mixer failed")),
    ],
)
def test_a_step_that_raises_frees_every_block_and_forgets_its_requests(request, arch, where, error, monkeypatch):
    model = request.getfixturevalue(arch)
    engine = Engine(model, num_blocks=12, max_num_seqs=2, max_num_batched_tokens=16)
    free = engine.kv.block_pool.num_free_blocks
    with monkeypatch.context() as patch:
        _inject(engine, where, _fail_after(3, error), patch)
        with pytest.raises(type(error)):
            engine.generate(prompts_for([20, 7, 30], seed=1), 6)
        getattr(engine, "_remove_test_hook", lambda: None)()
    assert engine.kv.block_pool.num_free_blocks == free
    assert not engine.scheduler.has_work
    assert sorted(engine.scheduler._free_rows) == [0, 1]
    finished = engine.stats().requests_finished
    prompts = prompts_for([11, 25], seed=2)
    assert engine.generate(prompts, 6) == reference(model, prompts, 6)
    assert engine.stats().requests_finished == finished + 2  # the aborted requests did not run again
    assert engine.kv.block_pool.num_free_blocks == free
