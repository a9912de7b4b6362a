"""``kvcore bench hf --kv-cache-dtype``: the quantized cache against the model-dtype one, one run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("kvcore_triton.backend")  # NOTE: interpreted kernels, as in every CPU test

from kvcore.cli import main  # noqa: E402
from kvcore_triton._checks import INTERPRETED  # noqa: E402

#: The Triton backend on CPU tensors runs through Triton's interpreter (``make test`` turns it on).
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and an interpreter that runs")

TINY = ["bench", "hf", "--device", "cpu", "--backend", "torch", "--layers", "2", "--hidden", "64",
        "--intermediate", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128", "--requests", "4",
        "--prompt-len", "12", "--new-tokens", "4", "--shared-prefix", "0", "--block-size", "16",
        "--skip", "generate_batch,static,prefix,profile"]


@pytest.mark.parametrize("mode", ["fp8", "int8_per_token_head"])
def test_reports_speed_agreement_and_attention_error_against_the_model_dtype_cache(mode, capsys, tmp_path):
    out = tmp_path / "hf.json"
    assert main([*TINY, "--kv-cache-dtype", mode, "--check-requests", "2", "--check-prompt-len", "8",
                 "--check-new-tokens", "2", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    quant = result["quantized"]
    assert result["engine"]["kv_cache_dtype"] == mode
    assert quant["requests"] == 4 and 0 <= quant["same_requests"] <= 4
    assert quant["unquantized"]["output_tokens"] == result["kvcore"]["output_tokens"] == 16
    assert 0 < quant["attention_rel_l2"] < 4e-2
    # NOTE: the float32 exactness check runs on the model-dtype cache, so it still holds.
    assert result["check"]["plain"] == result["check"]["requests"]
    text = capsys.readouterr().out
    assert f"KV cache {mode}" in text and "generate the same greedy tokens" in text
    assert "reference" in quant["exact_other_rounding"]["not_run"] and "For scale" not in text


@needs_interpreter
def test_agreement_comes_with_the_model_dtype_cache_through_another_exact_backend(capsys, tmp_path):
    out = tmp_path / "hf.json"
    argv = [*TINY, "--backend", "triton", "--dtype", "float32", "--kv-cache-dtype", "int8_per_token_head",
            "--skip", "generate_batch,static,prefix,profile,check", "--json-out", str(out)]
    assert main(argv) == 0
    quant = json.loads(out.read_text())["quantized"]
    assert quant["unquantized"]["backend"] == "triton"
    # NOTE: float32 and two exact attention kernels: every request keeps its tokens
    assert quant["exact_other_rounding"] == {"backend": "torch", "same_requests": 4}
    text = " ".join(capsys.readouterr().out.split())
    assert "through the torch backend (exact attention, other rounding) keeps 4/4 requests' tokens" in text


def test_without_the_option_nothing_extra_runs(tmp_path):
    out = tmp_path / "hf.json"
    assert main([*TINY, "--skip", "generate_batch,static,prefix,profile,check", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "quantized" not in result and result["engine"]["kv_cache_dtype"] == "auto"


@needs_interpreter
def test_a_reference_run_that_cannot_serve_is_reported_and_the_rest_kept(capsys, tmp_path, monkeypatch):
    from kvcore.errors import KVCoreError
    from kvcore_bench import _hf_runs

    served = _hf_runs.run_kvcore

    def refusing(model, prompts, warmup, new_tokens, engine_kwargs, **kw):
        if engine_kwargs.get("backend") == "torch":
            raise KVCoreError("the torch backend cannot serve this model here")
        return served(model, prompts, warmup, new_tokens, engine_kwargs, **kw)

    monkeypatch.setattr(_hf_runs, "run_kvcore", refusing)
    out = tmp_path / "hf.json"
    argv = [*TINY, "--backend", "triton", "--kv-cache-dtype", "fp8", "--skip",
            "generate_batch,static,prefix,profile,check", "--json-out", str(out)]
    assert main(argv) == 0
    quant = json.loads(out.read_text())["quantized"]
    assert quant["exact_other_rounding"] == {"not_run": "KVCoreError: the torch backend cannot serve this model here"}
    assert quant["unquantized"]["output_tokens"] == 16 and 0 <= quant["same_requests"] <= 4
    assert "For scale, the torch backend's run: not run: KVCoreError" in " ".join(capsys.readouterr().out.split())


@needs_interpreter
def test_skip_reference_leaves_out_the_torch_backends_run(capsys, tmp_path, monkeypatch):
    from kvcore_bench import _hf_runs

    served, backends = _hf_runs.run_kvcore, []
    monkeypatch.setattr(_hf_runs, "run_kvcore", lambda *args, **kw: backends.append(args[4]["backend"])
                        or served(*args, **kw))
    out = tmp_path / "hf.json"
    argv = [*TINY, "--backend", "triton", "--kv-cache-dtype", "fp8", "--skip",
            "generate_batch,static,prefix,profile,check,reference", "--json-out", str(out)]
    assert main(argv) == 0
    quant = json.loads(out.read_text())["quantized"]
    assert backends == ["triton", "triton"]
    assert quant["exact_other_rounding"] == {"not_run": "left out (--skip reference)"}
    assert quant["unquantized"]["output_tokens"] == 16
    text = capsys.readouterr().out
    assert "generate the same greedy tokens" in text and "For scale" not in text
