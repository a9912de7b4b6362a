"""``kvcore bench hf``: kvcore.hf.Engine against transformers' generate_batch and static generate (GPU).

A random-weight Llama-style model (default: hidden 2048, 16 layers, 32 query
/ 8 KV heads, vocab 32,000, bf16) serves the same requests (default 256
prompts of 256 tokens, 128 new tokens each, no EOS) through
``kvcore.hf.Engine`` (Triton backend, CUDA graphs for decode steps), through
``model.generate_batch`` (transformers' paged continuous batching) and
through one batched ``model.generate`` (static batch, dense cache), in one
run: output tokens/s, ratios, the fraction of a roofline (prefill at the
matrix peak, every decode step reading the weights and the KV cache once),
and where kvcore's step time goes. Then a shared-prefix workload (every
prompt behind one common prefix) with prefix caching off and on, and a
smaller float32 model whose greedy tokens must equal ``model.generate``'s.

``--model hybrid`` times a Granite-4.0-H-like hybrid instead (Mamba2 mixers,
one attention layer in eight; :mod:`kvcore.bench._hf_runs`) against the
static ``model.generate``; transformers' ``generate_batch`` and prefix
caching do not serve hybrids, so those parts are left out.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvcore.bench import emit
from kvcore.bench.options import hf_arguments as add_arguments

#: A workload that runs in seconds on a CPU, for the message that refuses the GPU-sized defaults.
CPU_EXAMPLE = (
    "--device cpu --backend torch --hidden 128 --intermediate 256 --layers 2 --heads 4 "
    "--kv-heads 2 --vocab 512 --requests 4 --prompt-len 16 --new-tokens 4 --shared-prefix 0 "
    "--block-size 16 --skip generate_batch,static,check"
)
#: Most model work (about 2 * parameters * tokens) a CPU run may ask for: tens of seconds.
CPU_MAX_FLOP = 5e11


def _blocks(requests: int, tokens: int, block_size: int) -> int:
    return requests * -(-tokens // block_size) + 2 * requests + 1


def resolve_device(device: torch.device | None) -> torch.device:
    """``--device``, or CUDA; without CUDA the GPU-sized defaults are refused at once."""
    if device is not None:
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    raise ValueError(
        "no CUDA device here, and the default workload (a 0.85 B model serving 256 requests) is "
        f"sized for a GPU; run it on a GPU machine, or try a CPU-sized run: kvcore bench hf "
        f"{CPU_EXAMPLE}"
    )


def check_cpu_sized(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse at once a CPU run whose workload would take many minutes without a word."""
    h = args.hidden
    params = args.layers * (4 * h**2 + 3 * h * args.intermediate) + 2 * args.vocab * h
    flop = 2.0 * params * args.requests * (args.prompt_len + args.new_tokens)
    if device.type == "cpu" and flop > CPU_MAX_FLOP:
        raise ValueError(
            f"this workload is about {flop:.1e} floating-point operations, minutes to hours on a "
            f"CPU (at most {CPU_MAX_FLOP:.0e} here); shrink it, e.g. kvcore bench hf {CPU_EXAMPLE}"
        )


def preflight(backend: str, device: torch.device, block_size: int | None, dtype: torch.dtype,
              head_dim: int) -> None:
    """Serve one token of a tiny random model through ``backend`` on ``device`` first.

    A backend that cannot run there (an unknown name, Triton on CPU without
    ``TRITON_INTERPRET=1``) is refused in about a second, with its own reason,
    instead of after minutes of building the benchmark's model.
    """
    from kvcore.bench._hf_runs import model_config
    from kvcore.hf import Engine
    from kvcore.hf.models import random_model

    # NOTE: the benchmark's dtype and head size, which a backend's requirements may restrict.
    tiny = model_config("llama", vocab=64, hidden=2 * head_dim, intermediate=64, layers=1, heads=2,
                        kv_heads=1, max_pos=64, head_dim=head_dim)
    model = random_model(tiny, dtype=dtype, device=device, seed=0)
    try:
        engine = Engine(model, backend=backend, block_size=block_size, num_blocks=4,
                        max_num_seqs=1, max_num_batched_tokens=64, cuda_graphs=False)
        engine.generate([[2, 3, 4]], 1)
    except Exception as exc:  # NOTE: any failure means the benchmark cannot run; say why at once
        raise ValueError(
            f"--backend {backend} cannot serve a tiny model on {device}: {exc}"
        ) from exc


def format_count(n: float) -> str:
    """A parameter count as people write it: ``851.4 M``, ``1.24 B``, ``96.3 K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:,.0f} {unit}"
    return f"{n:.0f}"


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Run every part; the result is what ``--json`` prints."""
    # NOTE: imported here, when the benchmark runs: transformers is an optional extra.
    import transformers

    from kvcore.bench import _hf_runs as runs
    from kvcore.hf.models import random_model

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    preflight(args.backend, device, args.block_size, dtype, args.hidden // args.heads)
    check_cpu_sized(args, device)
    skip = set(args.skip)
    hybrid = args.model == "hybrid"
    if hybrid:  # NOTE: no generate_batch, prefix caching or CUDA graphs to compare with
        skip |= {"generate_batch", "prefix", "eager"}
    n, p, m, prefix = args.requests, args.prompt_len, args.new_tokens, max(args.shared_prefix, 0)
    config = runs.bench_config(args, max(2048, prefix + p + m))
    model = random_model(config, dtype=dtype, device=device, seed=0)
    prompts, warm = (runs.random_prompts(n, p, args.vocab, seed) for seed in (1, 2))
    if args.block_size is None:  # NOTE: the engine's own default, to size the cache below
        from kvcore.hf.engine import resolve_defaults as resolve
        from kvcore.hf.specs import specs_from_config

        args.block_size = resolve(
            lambda size: specs_from_config(config, dtype=model.dtype, block_size=size),
            device, args.backend, None, None,
        ).block_size
    engine_kwargs = dict(
        backend=args.backend, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_blocks=_blocks(n, p + m, args.block_size),
        cuda_graphs=False if args.no_cuda_graphs else None,
    )
    if hybrid:  # NOTE: a state slot per request and state group: the engine's default share
        engine_kwargs.update(num_blocks=None, available_memory=None)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "workload": {"requests": n, "prompt_len": p, "new_tokens": m, "dtype": args.dtype,
                     "model": config.model_type},
        "engine": dict(engine_kwargs),
    }
    out["kvcore"], _ = runs.run_kvcore(model, prompts, warm, m, engine_kwargs,
                                       profile="profile" not in skip)
    if "eager" not in skip and device.type == "cuda" and not args.no_cuda_graphs:
        out["kvcore_eager"], _ = runs.run_kvcore(model, prompts, warm, m,
                                                 {**engine_kwargs, "cuda_graphs": False})
    if "generate_batch" not in skip:
        out["generate_batch"] = runs.run_generate_batch(model, prompts, warm[: min(n, 16)], m)
    if "static" not in skip:
        out["static_generate"] = runs.run_static_generate(model, prompts, m)
    out["roofline"] = runs.roofline(model, n, p, m, peak_tflops=args.peak_tflops,
                                    hbm_tbps=args.hbm_tbps)
    if prefix and "prefix" not in skip:
        common, other = (runs.random_prompts(1, prefix, args.vocab, seed)[0] for seed in (3, 4))
        shared, shared_warm = [common + q for q in prompts], [other + q for q in warm]
        kwargs = {**engine_kwargs, "num_blocks": _blocks(n, prefix + p + m, args.block_size)}
        served = {key: runs.run_kvcore(model, shared, shared_warm, m,
                                       {**kwargs, "enable_prefix_caching": key == "on"})
                  for key in ("off", "on")}
        # NOTE: in bf16 a GEMM's rounding depends on the batch it runs in, so caching may flip some
        # greedy tokens of a random model; the float32 check below asserts equality.
        same = sum(a == b for a, b in zip(served["on"][1], served["off"][1]))
        out["prefix"] = {"prefix_len": prefix, "same_requests": same, "requests": n,
                         "off": served["off"][0], "on": served["on"][0]}
    del model
    if "check" not in skip:
        out["check"] = runs.run_check(args, engine_kwargs, device)
    return out


def _tps(result: dict[str, Any]) -> float:
    return result["output_tokens"] / result["seconds"]


def report(out: dict[str, Any], console: Console) -> None:
    w, versions = out["workload"], out["versions"]
    console.print(
        f"[bold]kvcore bench hf[/] on {out['device']} (torch {versions['torch']}, transformers "
        f"{versions['transformers']}): {w['requests']} requests x ({w['prompt_len']} prompt + "
        f"{w['new_tokens']} new) tokens, {w['dtype']}, "
        f"{format_count(out['roofline']['params'])} parameters"
    )
    kv_tps = _tps(out["kvcore"])
    table = Table(title="output tokens/s (timed pass after a warm-up pass)")
    table.add_column("engine", no_wrap=True)
    for col in ("output tokens", "seconds", "tokens/s", "kvcore is x faster"):
        table.add_column(col, justify="right")
    for name, key in (("kvcore.hf.Engine", "kvcore"), ("kvcore, no CUDA graphs", "kvcore_eager"),
                      ("model.generate_batch", "generate_batch"),
                      ("static model.generate", "static_generate")):
        if key in out:
            r = out[key]
            table.add_row(name, f"{r['output_tokens']:,}", f"{r['seconds']:.2f}",
                          f"{_tps(r):,.0f}", f"{kv_tps / _tps(r):.2f}")
    roof = out["roofline"]
    table.add_row("roofline", "", f"{roof['prefill_s'] + roof['decode_s']:.3f}",
                  f"{roof['tokens_per_s']:,.0f}", f"{kv_tps / roof['tokens_per_s']:.1%} of it")
    console.print(table)
    k = out["kvcore"]
    console.print(
        f"kvcore: backend {k['backend']}, {k['layout']}, block {out['engine']['block_size']}; "
        f"engine built in {k['build_s']:.1f} s; first generate {k['warmup_s']:.2f} s, second "
        f"{k['seconds']:.2f} s (first runs at {k['first_vs_second']:.2f}x the second's speed)"
    )
    _report_steps(out["kvcore"], console)
    if "prefix" in out:
        pre = out["prefix"]
        t = Table(title=f"shared prefix of {pre['prefix_len']} tokens ({pre['same_requests']}/"
                  f"{pre['requests']} requests' tokens equal with caching on and off)")
        for col in ("prefix caching", "tokens/s", "prefill tokens", "hits", "prefill skipped",
                    "blocks zeroed"):
            t.add_column(col, justify="right")
        for key in ("off", "on"):
            s = pre[key]["stats"]
            t.add_row(key, f"{_tps(pre[key]):,.0f}", f"{s['prefill_tokens']:,}",
                      f"{s['prefix_cache_hits']:,}", f"{s['prefix_cache_hit_tokens']:,}",
                      f"{s['blocks_zeroed']:,}")
        console.print(t)
    c = out.get("check", {})
    for key, label in (("plain", "prefix caching off"), ("prefix_caching", "prefix caching on")):
        if key in c:
            colour = "green" if c[key] == c["requests"] else "red"
            console.print(f"float32 check, {label}: [{colour}]{c[key]}/{c['requests']}[/] "
                          f"requests' greedy tokens equal model.generate "
                          f"({c[f'{key}_hit_tokens']} prompt tokens from the cache)")


_PHASES = {"schedule": "scheduler", "prepare": "inputs, metadata, block tables",
           "zero": "zeroing new blocks", "forward": "model forward (launch / replay)",
           "sample": "sampling (waits for the device)"}


def _report_steps(kv: dict[str, Any], console: Console) -> None:
    s, prof = kv["stats"], kv.get("profile")
    table = Table(title=f"kvcore step time: {s['steps']} steps ({s['graph_steps']} replayed from "
                  "CUDA graphs)")
    table.add_column("phase", no_wrap=True)  # NOTE: labels stay whole; number headers wrap instead
    table.add_column("ms/step (async)", justify="right")
    if prof:
        table.add_column("ms/step (synced)", justify="right")
        table.add_column("share (synced)", justify="right")
        total = sum(prof[f"{phase}_s"] for phase in _PHASES)
    for phase, label in _PHASES.items():
        row = [label, f"{1e3 * s[f'{phase}_s'] / max(s['steps'], 1):.3f}"]
        if prof:
            row += [f"{1e3 * prof[f'{phase}_s'] / max(prof['steps'], 1):.3f}",
                    f"{prof[f'{phase}_s'] / total:.1%}"]
        table.add_row(*row)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    out = collect(args)
    emit(args, out, lambda r: report(r, Console()))
    check = out.get("check", {})
    ok = all(check[k] == check["requests"] for k in ("plain", "prefix_caching") if k in check)
    return 0 if ok else 1
