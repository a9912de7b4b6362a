"""``kvcore bench hf``: kvcore.hf.Engine against transformers' generate_batch and static generate (GPU).

A random-weight Llama-style model (default: hidden 2048, 16 layers, 32 query /
8 KV heads, vocab 32,000, bf16) serves the same requests (default 256 prompts of
256 tokens, 128 new tokens, no EOS) through ``kvcore.hf.Engine`` (by default the
Triton backend, CUDA graphs for decode steps), ``model.generate_batch``
(transformers' paged continuous batching) and one batched ``model.generate``
(static batch): output tokens/s, ratios, a roofline and where kvcore's step
time goes. Then a shared-prefix workload with prefix caching off and on, and a
float32 model whose greedy tokens must equal ``model.generate``'s.
``--kv-cache-dtype MODE`` serves from a quantized cache and, in the same run, from
the model-dtype cache: tokens/s of both and the share of requests whose greedy
tokens are the same, plus the attention error of MODE at this model's shape.
``--model hybrid`` times a Granite-4.0-H-like hybrid (Mamba2 mixers) against the
static ``model.generate`` (at the largest batch that fits) and, in the same run,
kvcore serving a Llama of the same dimensions; ``generate_batch`` does not serve
hybrids (prefix caching keeps state checkpoints for them).
"""

import argparse
import textwrap
from typing import Any

import torch

from kvcore._table import terminal_width
from kvcore_bench import emit, machine, table
from kvcore_bench.options import ARGUMENTS

add_arguments = ARGUMENTS["hf"]

#: A workload that runs in seconds on a CPU, for the message that refuses the GPU-sized defaults.
CPU_EXAMPLE = (
    "--device cpu --backend torch --hidden 128 --intermediate 256 --layers 2 --heads 4 "
    "--kv-heads 2 --vocab 512 --requests 4 --prompt-len 16 --new-tokens 4 --shared-prefix 0 "
    "--block-size 16 --skip generate_batch,static,check"
)
#: Most model work (about 2 * parameters * tokens) a CPU run may ask for: tens of seconds.
CPU_MAX_FLOP = 5e11
#: Dense bf16 matrix peak (TFLOP/s) and memory bandwidth (TB/s) of GPUs by name, for the roofline.
PEAKS = {"H200": (989.0, 4.8), "H100": (989.0, 3.35)}


def known_peaks(args: argparse.Namespace, device_name: str) -> tuple[float, float] | None:
    """The roofline's peaks: ``--peak-tflops`` / ``--hbm-tbps``, else the device's own where known."""
    own = next((peaks for name, peaks in PEAKS.items() if name in device_name), None)
    if own is None and (args.peak_tflops is None or args.hbm_tbps is None):
        return None
    return (args.peak_tflops or own[0], args.hbm_tbps or own[1])


def checked_device(args: argparse.Namespace) -> torch.device:
    """``--device`` (default: CUDA), after refusing at once what cannot run: GPU-sized work
    on a CPU, or a backend that cannot serve a tiny model (before the big one is built)."""
    from kvcore.hf import Engine
    from kvcore.hf.models import random_model
    from kvcore_bench._hf_runs import model_config

    device = args.device or (torch.device("cuda") if torch.cuda.is_available() else None)
    if device is None:
        raise ValueError(
            "no CUDA device here, and the default workload (a 0.85 B model serving 256 requests) "
            "is sized for a GPU; run it on a GPU machine, or try a CPU-sized run: kvcore bench hf "
            f"{CPU_EXAMPLE}"
        )
    # NOTE: the benchmark's dtype and head size, which a backend's requirements may restrict.
    head_dim = args.hidden // args.heads
    tiny = model_config("llama", vocab=64, hidden=2 * head_dim, intermediate=64, layers=1, heads=2,
                        kv_heads=1, max_pos=64, head_dim=head_dim)
    model = random_model(tiny, dtype=getattr(torch, args.dtype), device=device, seed=0)
    try:
        engine = Engine(model, backend=args.backend, block_size=args.block_size, num_blocks=4,
                        max_num_seqs=1, max_num_batched_tokens=64, cuda_graphs=False)
        engine.generate([[2, 3, 4]], 1)
    except Exception as exc:  # NOTE: any failure means the benchmark cannot run; say why at once
        raise ValueError(
            f"--backend {args.backend} cannot serve a tiny model on {device}: {exc}"
        ) from exc
    h = args.hidden
    params = args.layers * (4 * h**2 + 3 * h * args.intermediate) + 2 * args.vocab * h
    flop = 2.0 * params * args.requests * (args.prompt_len + args.new_tokens)
    if device.type == "cpu" and flop > CPU_MAX_FLOP:
        raise ValueError(
            f"this workload is about {flop:.1e} floating-point operations, minutes to hours on a "
            f"CPU (at most {CPU_MAX_FLOP:.0e} here); shrink it, e.g. kvcore bench hf {CPU_EXAMPLE}"
        )
    return device


def default_block_size(config: Any, dtype: torch.dtype, device: torch.device, backend: str) -> int:
    """The block size ``kvcore.hf.Engine`` picks for ``config`` by default."""
    from kvcore.hf.engine import resolve_defaults
    from kvcore.hf.specs import specs_from_config

    make_specs = lambda size: specs_from_config(config, dtype=dtype, block_size=size)  # noqa: E731
    return resolve_defaults(make_specs, device, backend, None, None).block_size


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

    from kvcore.hf.models import random_model
    from kvcore_bench import _hf_runs as runs

    device = checked_device(args)
    dtype = getattr(torch, args.dtype)
    skip = set(args.skip)
    hybrid = args.model == "hybrid"
    if hybrid:  # NOTE: transformers' generate_batch does not serve hybrids
        skip |= {"generate_batch"}
    n, p, m, prefix = args.requests, args.prompt_len, args.new_tokens, max(args.shared_prefix, 0)
    config = runs.bench_config(args, max(2048, prefix + p + m))
    model = random_model(config, dtype=dtype, device=device, seed=0)
    prompts, warm = (runs.random_prompts(n, p, args.vocab, seed) for seed in (1, 2))
    if args.block_size is None:  # NOTE: the engine's own default, to size the cache below
        args.block_size = default_block_size(config, model.dtype, device, args.backend)

    def blocks(tokens: int, block_size: int | None = None) -> int:
        return n * -(-tokens // (block_size or args.block_size)) + 2 * n + 1

    engine_kwargs = dict(
        backend=args.backend, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        num_blocks=blocks(p + m), mixer_backend=args.mixer_backend,
        cuda_graphs=False if args.no_cuda_graphs else None,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if hybrid:  # NOTE: a state slot per request and state group: the engine's default share
        engine_kwargs.update(num_blocks=None, available_memory=None)
    out: dict[str, Any] = {
        "device": machine(device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "workload": {"requests": n, "prompt_len": p, "new_tokens": m, "dtype": args.dtype,
                     "model": config.model_type},
        "engine": dict(engine_kwargs),
    }
    out["kvcore"], outputs = runs.guarded(lambda: runs.run_kvcore(model, prompts, warm, m, engine_kwargs,
                                                                  profile="profile" not in skip))
    if args.kv_cache_dtype != "auto" and outputs:
        out["quantized"], _ = runs.guarded(lambda: (runs.run_unquantized(
            model, prompts, warm, m, engine_kwargs, outputs, with_reference="reference" not in skip), []))
    if "eager" not in skip and device.type == "cuda" and not args.no_cuda_graphs:
        out["kvcore_eager"], _ = runs.guarded(lambda: runs.run_kvcore(
            model, prompts, warm, m, {**engine_kwargs, "cuda_graphs": False}))
    if "generate_batch" not in skip:
        out["generate_batch"] = runs.run_generate_batch(model, prompts, warm[: min(n, 16)], m)
    if "static" not in skip:
        out["static_generate"] = runs.run_static_generate(model, prompts, m)
    # NOTE: the timed model's roofline, before a hybrid's model gives way to the same-dims Llama
    out["params"] = sum(t.numel() for t in model.parameters())
    peaks = known_peaks(args, out["device"])
    out["roofline"] = peaks and runs.roofline(model, n, p, m, peak_tflops=peaks[0], hbm_tbps=peaks[1])
    if prefix and "prefix" not in skip:
        common, other = (runs.random_prompts(1, prefix, args.vocab, seed)[0] for seed in (3, 4))
        shared, shared_warm = [common + q for q in prompts], [other + q for q in warm]
        kwargs = {**engine_kwargs, "num_blocks": blocks(prefix + p + m)}
        served = {key: runs.guarded(lambda key=key: runs.run_kvcore(
            model, shared, shared_warm, m, {**kwargs, "enable_prefix_caching": key == "on"}))
            for key in ("off", "on")}
        missing = [f"caching {key}: {served[key][0]['not_run']}" for key in served if "not_run" in served[key][0]]
        # NOTE: in bf16 a GEMM's rounding depends on the batch it runs in, so caching may flip some
        # greedy tokens of a random model; the float32 check below asserts equality.
        same = sum(a == b for a, b in zip(served["on"][1], served["off"][1]))
        out["prefix"] = {"not_run": "; ".join(missing)} if missing else {
            "prefix_len": prefix, "same_requests": same, "requests": n,
            "off": served["off"][0], "on": served["on"][0]}
    if hybrid and "llama" not in skip:  # NOTE: the same dimensions with attention in every layer
        model = None  # NOTE: frees the hybrid before the Llama is built
        llama = runs.model_config("llama", vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                                  intermediate=args.intermediate, heads=args.heads,
                                  kv_heads=args.kv_heads, max_pos=config.max_position_embeddings)
        size = default_block_size(llama, dtype, device, args.backend)

        def run_llama() -> tuple[dict, list]:
            llama_model = random_model(llama, dtype=dtype, device=device, seed=0)
            return runs.run_kvcore(llama_model, prompts, warm, m, {
                **engine_kwargs, "block_size": size, "num_blocks": blocks(p + m, size)})

        out["llama"], _ = runs.guarded(run_llama)
    model = None
    if "check" not in skip:
        out["check"] = runs.run_check(args, engine_kwargs, device)
    return out


def _tps(result: dict[str, Any]) -> float:
    return result["output_tokens"] / result["seconds"]


def _mixers(kv: dict[str, Any]) -> str:
    return f" (mixers: {', '.join(kv['mixer_backends'])})" if kv.get("mixer_backends") else ""


def _label(key: str, name: str, result: dict[str, Any]) -> str:
    """An engine's row label; a static batch smaller than the workload says its size."""
    return f"{name} (batch {result['batch']})" if result.get("out_of_memory_at") else name


_ENGINES = {"kvcore": "kvcore.hf.Engine", "kvcore_eager": "kvcore, no CUDA graphs",
            "llama": "kvcore, same-dims Llama", "generate_batch": "model.generate_batch",
            "static_generate": "static model.generate"}
_PHASES = {"schedule": "scheduler", "prepare": "inputs, metadata, block tables",
           "zero": "zeroing new blocks", "forward": "model forward (launch / replay)",
           "sample": "sampling (waits for the device)"}


def _kvcore_vs(kvcore_tps: float, row: dict[str, Any]) -> str:
    """kvcore's tokens/s against ``row``'s: a ratio, or the share of the roofline it reaches."""
    if row["engine"] == "roofline":
        return f"{kvcore_tps / row['tps']:.1%} of it"
    return f"{kvcore_tps / row['tps']:.2f}"


def _step_table(kv: dict[str, Any], width: int) -> str:
    """Where kvcore's step time goes, per phase: async from its stats, synced from its profile."""
    stats, profile = kv["stats"], kv.get("profile")
    total = sum(profile[f"{phase}_s"] for phase in _PHASES) if profile else None
    rows = []
    for phase, label in _PHASES.items():
        row = {"phase": label, "async_ms": 1e3 * stats[f"{phase}_s"] / max(stats["steps"], 1)}
        if profile:
            row["synced_ms"] = 1e3 * profile[f"{phase}_s"] / max(profile["steps"], 1)
            row["synced_share"] = profile[f"{phase}_s"] / total
        rows.append(row)
    spec = [("phase", "phase", ""), ("ms/step (async)", "async_ms", ".3f")]
    if profile:
        spec += [("ms/step (synced)", "synced_ms", ".3f"),
                 ("share (synced)", "synced_share", ".1%")]
    return table(f"kvcore step time: {stats['steps']} steps ({stats['graph_steps']} replayed "
                 "from CUDA graphs)", spec, rows, width)


def report(out: dict[str, Any]) -> None:
    width = terminal_width()
    work, versions, roof, kv = out["workload"], out["versions"], out["roofline"], out["kvcore"]
    print(textwrap.fill(
        f"kvcore bench hf on {out['device']}; torch {versions['torch']}, transformers "
        f"{versions['transformers']}: {work['requests']} requests x ({work['prompt_len']} prompt "
        f"+ {work['new_tokens']} new) tokens, {work['dtype']}, {format_count(out['params'])} "
        "parameters", width))
    rows = [{"engine": _label(key, name, out[key]), **out[key], "tps": _tps(out[key])}
            for key, name in _ENGINES.items() if key in out and "not_run" not in out[key]]
    if roof:
        rows.append({"engine": "roofline", "output_tokens": None, "tps": roof["tokens_per_s"],
                     "seconds": roof["prefill_s"] + roof["decode_s"]})
    kv_tps = None if "not_run" in kv else _tps(kv)
    for row in rows:
        row["kvcore_vs"] = "-" if kv_tps is None else _kvcore_vs(kv_tps, row)
    print(table("output tokens/s (timed pass after a warm-up pass)", [
        ("engine", "engine", ""), ("output tokens", "output_tokens", ","),
        ("seconds", "seconds", ".2f"), ("tokens/s", "tps", ",.0f"),
        ("kvcore is x faster", "kvcore_vs", "s"),
    ], rows, width))
    if not roof:
        print(textwrap.fill(f"no roofline: the peaks of {out['device']} are not known (pass "
                            "--peak-tflops and --hbm-tbps)", width, break_on_hyphens=False))
    static = out.get("static_generate", {})
    if "not_run" in static or static.get("out_of_memory_at"):
        done = "not run" if "not_run" in static else f"run at batch {static['batch']}"
        print(textwrap.fill(
            f"static model.generate: {done}; out of memory at batch "
            f"{', '.join(map(str, static['out_of_memory_at']))}", width))
    for key, name in (*_ENGINES.items(), ("prefix", "shared prefix"), ("quantized", "unquantized cache")):
        if key != "static_generate" and "not_run" in out.get(key, {}):
            print(textwrap.fill(f"{name}: not run: {out[key]['not_run']}", width))
    if kv_tps is not None:
        print(textwrap.fill(
            f"kvcore: backend {kv['backend']}{_mixers(kv)}, {kv['layout']}, block {out['engine']['block_size']}; "
            f"engine built in {kv['build_s']:.1f} s; first generate {kv['warmup_s']:.2f} s, second "
            f"{kv['seconds']:.2f} s (first runs at {kv['first_vs_second']:.2f}x the second's speed)",
            width))
        print(_step_table(kv, width))
    if "prefix" in out and "not_run" not in out["prefix"]:
        pre = out["prefix"]
        print(table(f"shared prefix of {pre['prefix_len']} tokens ({pre['same_requests']}/"
                    f"{pre['requests']} requests' tokens equal with caching on and off)", [
            ("prefix caching", "key", ""), ("tokens/s", "tps", ",.0f"),
            ("prefill tokens", "prefill_tokens", ","), ("hits", "prefix_cache_hits", ","),
            ("prefill skipped", "prefix_cache_hit_tokens", ","),
            ("blocks zeroed", "blocks_zeroed", ","),
        ], [{"key": key, "tps": _tps(pre[key]), **pre[key]["stats"]} for key in ("off", "on")],
            width))
        print(f"prefix caching on serves {_tps(pre['on']) / _tps(pre['off']):.2f}x the tokens/s of caching off")
    if "quantized" in out and "not_run" not in out["quantized"] and kv_tps is not None:
        q = out["quantized"]
        print(textwrap.fill(
            f"KV cache {out['engine']['kv_cache_dtype']}: {_tps(kv):,.0f} tokens/s, "
            f"{_tps(kv) / _tps(q['unquantized']):.2f}x the {work['dtype']} cache's "
            f"{_tps(q['unquantized']):,.0f}; {q['same_requests']}/{q['requests']} requests "
            f"({q['same_requests'] / q['requests']:.1%}) generate the same greedy tokens; attention "
            f"over the quantized cache at this shape is within rel. L2 {q['attention_rel_l2']:.2e} "
            "of float64 attention over the unquantized K/V", width))
        floor = q.get("exact_other_rounding", {})
        if "same_requests" in floor:
            print(textwrap.fill(
                f"For scale: the {work['dtype']} cache through the {floor['backend']} backend (exact "
                f"attention, other rounding) keeps {floor['same_requests']}/{q['requests']} requests' "
                f"tokens; agreement below that is this model's sensitivity, not the cache's", width))
        elif not floor.get("not_run", "the timed backend").startswith(("the timed backend", "left out")):
            print(textwrap.fill(f"For scale, the torch backend's run: not run: {floor['not_run']}", width))
    check = out.get("check", {})
    for key, label in (("plain", "prefix caching off"), ("prefix_caching", "prefix caching on")):
        if f"{key}_not_run" in check:
            print(textwrap.fill(f"float32 check, {label}: not run: {check[f'{key}_not_run']}", width))
        if key in check:
            print(textwrap.fill(
                f"float32 check, {label}: {check[key]}/{check['requests']} requests' greedy "
                f"tokens equal model.generate ({check[f'{key}_hit_tokens']} prompt tokens from "
                "the cache)", width))


def run(args: argparse.Namespace) -> int:
    out = collect(args)
    emit(args, out, report)
    check = out.get("check", {})
    parts = [key for key in ("plain", "prefix_caching") if key in check]
    ok = all(check[key] == check["requests"] for key in parts) and not any(k.endswith("_not_run") for k in check)
    return 0 if ok else 1
