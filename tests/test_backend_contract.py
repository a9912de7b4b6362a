"""One contract for ``forward``: it returns the output, written into ``out`` when ``out`` is given.

kvcore's engine uses the returned tensor, so a backend that returns its result without filling
``out`` still serves exact tokens; the backend test kit (``kvcore.testing.run_forward``, and
``examples/run_decode.py``'s checked runs) fails such a backend, and the guide's test snippet
works for a backend that implements ``forward`` and nothing else.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from kvcore import AttentionBackend
from kvcore.errors import PluginError
from kvcore.testing import build_cache, dense_reference, make_batch, run_forward
from kvcore_torch import TorchAttentionBackend

ROOT = Path(__file__).resolve().parents[1]


class ForwardOnly(AttentionBackend):
    """A backend with nothing but ``forward`` (no ``write_kv``, no builder of its own)."""

    name = "forward-only"

    @staticmethod
    def forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, sliding_window=None, out=None):
        return TorchAttentionBackend.forward(query, key, value, kv_cache_view, metadata, head_size=head_size,
                                             scale=scale, sliding_window=sliding_window, out=out)


class IgnoresOut(AttentionBackend):
    """Returns a fresh output and leaves ``out`` as it was given."""

    name = "ignores-out"

    @staticmethod
    def forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, sliding_window=None, out=None):
        return TorchAttentionBackend.forward(query, key, value, kv_cache_view, metadata, head_size=head_size,
                                             scale=scale, sliding_window=sliding_window)


class ReturnsNothing(AttentionBackend):
    """Writes ``out`` but returns None."""

    name = "returns-nothing"

    @staticmethod
    def forward(query, key, value, kv_cache_view, metadata, *, head_size, scale, sliding_window=None, out=None):
        TorchAttentionBackend.forward(query, key, value, kv_cache_view, metadata, head_size=head_size,
                                      scale=scale, sliding_window=sliding_window, out=out)


def _batch(seed, head_size=16):
    gen = torch.Generator().manual_seed(seed)
    return make_batch(gen, seq_lens=[37, 9, 5], q_lens=[6, 1, 5], kv_heads=2, q_heads=4, head_size=head_size,
                      dtype=torch.float32, num_blocks=16, block_size=8)


def test_run_forward_checks_a_backend_that_implements_forward_only():
    assert not hasattr(ForwardOnly, "write_kv")
    batch = _batch(0)
    view, _ = build_cache("BLNHC", 8, 16, kv_heads=2, head_size=16, dtype=torch.float32, device="cpu")
    out = run_forward(ForwardOnly, view, batch, scale=0.25)
    torch.testing.assert_close(out.double(), dense_reference(batch, 0.25), atol=1e-5, rtol=1e-5)


def test_run_forward_splits_blocks_and_windows_like_an_engine():
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(gen, seq_lens=[40, 13], q_lens=[3, 13], kv_heads=1, q_heads=2, head_size=8,
                       dtype=torch.float32, num_blocks=8, block_size=16, ratio=2)
    view, _ = build_cache("LBNHC", 16, 8, kv_heads=1, head_size=8, dtype=torch.float32, kernel_block_size=8,
                          device="cpu")
    out = run_forward(ForwardOnly, view, batch, scale=0.5, sliding_window=7)
    torch.testing.assert_close(out.double(), dense_reference(batch, 0.5, sliding_window=7), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend, words",
                         [(IgnoresOut, ": out gave"), (ReturnsNothing, r"forward\(\.\.\.\) gave None")])
def test_run_forward_fails_a_backend_that_breaks_the_out_contract(backend, words):
    view, _ = build_cache("LBNHC", 8, 16, kv_heads=2, head_size=16, dtype=torch.float32, device="cpu")
    with pytest.raises(AssertionError, match=words):
        run_forward(backend, view, _batch(1), scale=0.25)


def _guide_snippet() -> str:
    text = (ROOT / "docs" / "plugins.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "run_forward" in b)


def test_the_guides_test_snippet_runs_for_the_reference_and_for_your_own_backend():
    snippet = _guide_snippet()
    exec(compile(snippet, "docs/plugins.md", "exec"), {})
    own = snippet.replace("from kvcore_torch import TorchAttentionBackend as Backend", "Backend = ForwardOnly")
    assert own != snippet
    exec(compile(own, "docs/plugins.md", "exec"), {"ForwardOnly": ForwardOnly})
    broken = snippet.replace("from kvcore_torch import TorchAttentionBackend as Backend", "Backend = IgnoresOut")
    with pytest.raises(AssertionError, match="writes it into out when out is given"):
        exec(compile(broken, "docs/plugins.md", "exec"), {"IgnoresOut": IgnoresOut})


def _hf_model():
    pytest.importorskip("transformers")
    from kvcore.hf.models import model_config, random_model

    return random_model(model_config("gemma3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
                        seed=4)


def test_engine_serves_exact_tokens_from_a_backend_that_returns_its_output():
    from _hf_reference import prompts_for, reference

    from kvcore.hf import Engine

    model = _hf_model()
    prompts = prompts_for([11, 30, 5], seed=5)
    engine = Engine(model, backend=IgnoresOut, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=24)
    assert engine.generate(prompts, 6) == reference(model, prompts, 6)


def test_engine_names_a_backend_that_returns_no_output():
    from kvcore.hf import Engine

    engine = Engine(_hf_model(), backend=ReturnsNothing, num_blocks=32, max_num_seqs=2)
    with pytest.raises(PluginError, match="'returns-nothing' forward returned None .*forward returns the output"):
        engine.generate([[5, 6, 7]], 2)
    assert engine.kv.block_pool.num_free_blocks == engine.kv.num_blocks - 1  # nothing held after the failure


def test_run_decode_fails_a_backend_that_ignores_out(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import run_decode

    monkeypatch.setattr(run_decode, "get_backend", lambda name: IgnoresOut)
    assert run_decode.main(["--num-seqs", "2", "--steps", "3"]) == 1
    assert "forward returned its output without writing it into out=" in capsys.readouterr().out
    monkeypatch.setattr(run_decode, "get_backend", lambda name: ForwardOnly)
    assert run_decode.main(["--num-seqs", "2", "--steps", "3"]) == 0
    sys.modules.pop("run_decode", None)
