"""``kvcore bench hf`` off the GPU: refused at once, backends tried before the model, readable output."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

pytest.importorskip("transformers")
# NOTE: Triton reads TRITON_INTERPRET when its kernels are defined: import them now (interpreted,
# as in every CPU test), so that a test that turns the variable off changes only kvcore's checks.
pytest.importorskip("kvcore_triton.backend")
pytest.importorskip("kvcore.runtime.zeroer.kernel")

from kvcore import MambaSpec  # noqa: E402
from kvcore.cli import main  # noqa: E402
from kvcore.hf import specs_from_config  # noqa: E402
from kvcore_bench import hf  # noqa: E402
from kvcore_bench._hf_runs import bench_config  # noqa: E402


def test_gpu_sized_defaults_are_refused_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []
    monkeypatch.setattr("kvcore.hf.models.random_model", lambda *a, **k: built.append(a))
    assert main(["bench", "hf"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and hf.CPU_EXAMPLE in err and not built


def test_gpu_sized_work_on_an_explicit_cpu_is_refused_before_the_model_is_built(monkeypatch, capsys):
    import kvcore.hf.models as models

    sizes = []
    real = models.random_model
    monkeypatch.setattr(models, "random_model", lambda config, **kw: sizes.append(config.hidden_size)
                        or real(config, **kw))  # fmt: skip
    assert main(["bench", "hf", "--device", "cpu", "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "floating-point operations" in err and hf.CPU_EXAMPLE in err
    assert sizes == [128]  # the tiny preflight model only
    assert main(["bench", "hf", "--device", "cpu", "--backend", "torch", "--layers", "1", "--hidden", "64",
                 "--intermediate", "64", "--heads", "2", "--kv-heads", "1", "--vocab", "64", "--requests", "1",
                 "--prompt-len", "4", "--new-tokens", "2", "--shared-prefix", "0",
                 "--skip", "generate_batch,static,check,prefix,profile", "--json"]) == 0


def test_a_backend_that_cannot_run_is_refused_before_the_model_is_built(monkeypatch, capsys):
    from kvcore_triton import _checks

    monkeypatch.setattr(_checks, "INTERPRETED", False)  # NOTE: Triton fixes this at first import
    import kvcore.hf.models as models

    sizes = []
    real = models.random_model
    monkeypatch.setattr(models, "random_model", lambda config, **kw: sizes.append(config.hidden_size)
                        or real(config, **kw))  # fmt: skip
    assert main(["bench", "hf", "--device", "cpu", "--backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "--backend triton cannot serve a tiny model on cpu" in err and "TRITON_INTERPRET=1" in err
    assert sizes == [128]  # only the tiny preflight model (2 heads of the bench's 64), never the 2048-wide one
    assert main(["bench", "hf", "--device", "cpu", "--backend", "nope"]) == 2
    assert "Unknown attention backend 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("n, text", [(0, "0"), (999, "999"), (96_300, "96.3 K"), (427_136, "427 K"),
                                     (851_400_000, "851 M"), (1_240_000_000, "1.24 B"),
                                     (175_000_000_000, "175 B")])  # fmt: skip
def test_parameter_counts_read_as_people_write_them(n, text):
    assert hf.format_count(n) == text


def test_a_cpu_sized_run_fits_80_columns_with_whole_labels(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["bench", "hf", *hf.CPU_EXAMPLE.split(), "--new-tokens", "2", "--requests", "2", "--prompt-len", "4",
            "--layers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert re.search(r"\d+ K parameters", out) and "0.00 B" not in out
    for label in ("kvcore.hf.Engine", "inputs, metadata, block tables", "model forward (launch / replay)"):
        assert label in out


def test_the_benchmarks_hybrid_is_granite_4_h_like():
    args = argparse.Namespace(model="hybrid", vocab=512, hidden=128, intermediate=256, layers=16, heads=4, kv_heads=2)
    config = bench_config(args, 1024)
    specs = specs_from_config(config, dtype=torch.bfloat16)
    assert config.model_type == "granitemoehybrid" and config.num_local_experts == 0
    assert [n for n, s in specs.items() if not isinstance(s, MambaSpec)] == [
        "model.layers.4.self_attn", "model.layers.12.self_attn"]
    state = specs["model.layers.0.mamba"]
    assert state.shapes == ((4, 64, 128), (2 * 128 + 2 * 128, 4)) and state.dtypes == (torch.float32, torch.bfloat16)


def test_a_cpu_run_names_the_machine_and_draws_no_roofline_from_gpu_peaks(monkeypatch, capsys):
    argv = ["bench", "hf", *hf.CPU_EXAMPLE.split(), "--new-tokens", "2", "--requests", "2", "--prompt-len", "4",
            "--layers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on CPU (" in out and " cores)" in out
    assert "roofline" not in out.replace("no roofline: the peaks of CPU", "")
    assert main([*argv, "--peak-tflops", "2", "--hbm-tbps", "0.1", "--json"]) == 0  # the user's own peaks
    result = json.loads(capsys.readouterr().out)
    assert result["roofline"]["tokens_per_s"] > 0 and result["params"] > 0


@pytest.mark.parametrize("name, peaks", [("NVIDIA H200", (989.0, 4.8)), ("NVIDIA H100 80GB HBM3", (989.0, 3.35)),
                                         ("NVIDIA A10G", None), ("CPU (AMD EPYC, 2 cores)", None)])
def test_roofline_peaks_are_known_per_gpu(name, peaks):
    args = argparse.Namespace(peak_tflops=None, hbm_tbps=None)
    assert hf.known_peaks(args, name) == peaks


class _OutOfMemoryAbove:
    """A stand-in model whose ``generate`` runs out of memory above ``limit`` sequences."""

    device = torch.device("cpu")

    def __init__(self, limit: int) -> None:
        self.limit, self.batches = limit, []

    def generate(self, ids, *, max_new_tokens, **_):
        self.batches.append(ids.shape[0])
        if ids.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 GiB")
        return torch.cat([ids, torch.zeros(ids.shape[0], max_new_tokens, dtype=ids.dtype)], 1)


def test_the_static_baseline_halves_its_batch_until_it_fits_and_says_so(capsys):
    from kvcore_bench._hf_runs import run_static_generate

    model = _OutOfMemoryAbove(32)
    result = run_static_generate(model, [[3, 4, 5]] * 128, 6)
    assert result["batch"] == 32 and result["out_of_memory_at"] == [128, 64]
    assert result["output_tokens"] == 128 * 6 and model.batches[-4:] == [32] * 4
    nothing = run_static_generate(_OutOfMemoryAbove(0), [[3, 4]] * 4, 2)
    assert nothing == {"not_run": "out of memory at every batch size (4, 2, 1)", "out_of_memory_at": [4, 2, 1]}
    kv = {"output_tokens": 10, "seconds": 1.0, "warmup_s": 1.0, "build_s": 0.1, "first_vs_second": 1.0,
          "backend": "triton", "mixer_backends": ["triton-mixer"], "layout": "LBNHC",
          "stats": {"steps": 1, "graph_steps": 0, **{f"{p}_s": 0.0 for p in hf._PHASES}}}
    roof = {"tokens_per_s": 100.0, "prefill_s": 0.05, "decode_s": 0.05, "params": 1e6}
    work = {"requests": 4, "prompt_len": 2, "new_tokens": 2, "dtype": "bfloat16", "model": "granitemoehybrid"}
    for static, line in ((nothing, "static model.generate: not run; out of memory at batch 4, 2, 1"),
                         ({**result, "seconds": 2.0}, "static model.generate: run at batch 32")):
        hf.report({"device": "cpu", "versions": {"torch": "x", "transformers": "y"}, "workload": work,
                   "engine": {"block_size": 64}, "kvcore": kv, "static_generate": static, "roofline": roof,
                   "params": 1e6})
        out = capsys.readouterr().out
        assert line in " ".join(out.split()) and "(mixers: triton-mixer)" in out
        assert ("static model.generate (batch 32)" in out) == ("batch" in static)


def test_runs_that_run_out_of_memory_are_reported_as_not_run(monkeypatch, capsys, own_plugins):
    from kvcore_bench import _hf_runs

    served = _hf_runs.run_kvcore

    def short_of_memory(model, prompts, warmup, new_tokens, engine_kwargs, **kwargs):
        if model.config.model_type == "llama" or engine_kwargs.get("enable_prefix_caching"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        return served(model, prompts, warmup, new_tokens, engine_kwargs, **kwargs)

    monkeypatch.setattr(_hf_runs, "run_kvcore", short_of_memory)
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["bench", "hf", *hf.CPU_EXAMPLE.split(), "--model", "hybrid", "--requests", "2", "--prompt-len", "4",
            "--shared-prefix", "16", "--skip", "generate_batch,static,profile", "--check-requests", "2",
            "--check-prompt-len", "8", "--check-new-tokens", "2"]
    assert main(argv) == 1  # NOTE: the float32 check with caching on did not run
    out = " ".join(capsys.readouterr().out.split())
    assert "kvcore.hf.Engine" in out and "(mixers: torch-mixer)" in out
    for line in ("kvcore, same-dims Llama: not run: out of memory (CUDA out of memory. Tried to allocate 32.00 GiB)",
                 "shared prefix: not run: caching on: out of memory",
                 "float32 check, prefix caching on: not run: out of memory",
                 "float32 check, prefix caching off: 3/3 requests' greedy tokens equal model.generate"):
        assert line in out, out
    monkeypatch.setattr(_hf_runs, "run_kvcore", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    assert main(argv) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "kvcore.hf.Engine: not run: out of memory (x)" in out and "Traceback" not in out
