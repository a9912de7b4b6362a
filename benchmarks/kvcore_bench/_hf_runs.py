"""The random models and engines ``kvcore bench hf`` compares (imports transformers).

Every runner does one untimed warm-up pass (compilation, graph capture, allocator growth), then
times one pass, the device synchronized at both ends; output tokens are what it returned.
"""

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers

from kvcore.errors import InsufficientMemoryError, KVCoreError
from kvcore.hf import Engine

#: What a run that does not fit in device memory raises (the bench reports it as not run and goes on).
OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError, InsufficientMemoryError)


def model_config(kind: str, *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int, max_pos: int, **extra: Any) -> transformers.PretrainedConfig:
    """A Llama, or a Granite-4.0-H-like hybrid, config of these sizes."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                  **extra)
    if kind != "hybrid":
        return transformers.LlamaConfig(**common)
    # NOTE: Granite 4.0-H's dense "H-Micro" shape: Mamba2 mixers, one attention layer in eight,
    # a dense shared MLP, no position embedding.
    layer_types = ["attention" if i % 8 == 4 else "mamba" for i in range(layers)]
    if "attention" not in layer_types:
        layer_types[-1] = "attention"
    return transformers.GraniteMoeHybridConfig(
        **common, shared_intermediate_size=intermediate, num_local_experts=0,
        layer_types=layer_types, mamba_n_heads=2 * hidden // 64, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=256, position_embedding_type="nope",
    )


def bench_config(args: argparse.Namespace, max_pos: int) -> transformers.PretrainedConfig:
    """The timed model's config, from ``--model`` and the size flags."""
    return model_config(args.model, vocab=args.vocab, hidden=args.hidden,
                        intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                        kv_heads=args.kv_heads, max_pos=max_pos)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def guarded(run: Callable[[], tuple[dict, list]]) -> tuple[dict, list]:
    """``run()``'s figures and outputs, or ``{"not_run": why}`` and no outputs when it runs out of
    device memory (its memory is given back before the next run)."""
    try:
        return run()
    except OUT_OF_MEMORY as exc:
        why = f"out of memory ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})"
    gc.collect()  # NOTE: the failed engine, held by the traceback until now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"not_run": why}, []


def run_kvcore(model: Any, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int,
               engine_kwargs: dict[str, Any], *, profile: bool = False) -> tuple[dict, list]:
    """kvcore.hf.Engine's figures and outputs: warm up on ``warmup``, then time ``prompts``."""
    start = time.perf_counter()
    engine = Engine(model, **engine_kwargs)
    build_s = time.perf_counter() - start
    warm_s, _ = timed(engine.device, lambda: engine.generate(warmup, new_tokens))

    def stats_of_generate() -> tuple[float, Any, dict[str, float]]:
        before = engine.stats()
        seconds, outputs = timed(engine.device, lambda: engine.generate(prompts, new_tokens))
        return seconds, outputs, {k: v - before[k] for k, v in engine.stats().items()}

    seconds, outputs, stats = stats_of_generate()
    result = {
        "seconds": seconds, "warmup_s": warm_s, "build_s": build_s,
        "output_tokens": sum(len(o) for o in outputs), "stats": stats,
        "num_blocks": engine.kv.num_blocks, "layout": engine.kv.layout.name,
        "kernel_block_sizes": list(engine.kv.kernel_block_sizes),
        "backend": next(iter(engine._layers.values())).backend.get_name(),  # an attention layer's
        "mixer_backends": sorted({b.get_name() for b in engine.kv.mixer_backends.values()}),
        # Same-sized first and second generate: 1.0 when the first pays no compilation or capture.
        "first_vs_second": seconds / warm_s if warm_s else None,
    }
    if profile:
        engine.sync_timing = True
        result["profile_s"], _, result["profile"] = stats_of_generate()
    engine = None  # NOTE: frees the cache before the next engine is built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, outputs


def run_unquantized(model: Any, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int,
                    engine_kwargs: dict[str, Any], quantized_outputs: list, *, with_reference: bool = True
                    ) -> dict[str, Any]:
    """The same requests on the model-dtype cache: its figures, how many requests' greedy tokens
    equal the quantized cache's, and the attention error of the mode at the model's shape;
    ``with_reference``: also through the torch backend, for the model's own sensitivity."""
    from kvcore_torch.accuracy import attention_error

    unquantized = {**engine_kwargs, "kv_cache_dtype": "auto"}
    result, outputs = run_kvcore(model, prompts, warmup, new_tokens, unquantized)
    config = model.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    error = attention_error(engine_kwargs["kv_cache_dtype"], q_heads=config.num_attention_heads,
                            kv_heads=config.num_key_value_heads, head_size=head, device=model.device)
    out = {"unquantized": result, "same_requests": sum(a == b for a, b in zip(outputs, quantized_outputs)),
           "requests": len(prompts), "attention_rel_l2": error}
    # NOTE: how far this model's greedy tokens move when only attention's rounding changes: the
    # same cache through the reference backend (exact too), unless that is the timed backend.
    if result["backend"] == "torch":
        out["exact_other_rounding"] = {"not_run": "the timed backend is the torch reference"}
        return out
    if not with_reference:
        out["exact_other_rounding"] = {"not_run": "left out (--skip reference)"}
        return out

    def reference() -> tuple[dict, list]:
        try:
            _, tokens = run_kvcore(model, prompts, warmup[:1], new_tokens, {**unquantized, "backend": "torch"})
        except (ValueError, TypeError, KVCoreError) as exc:  # NOTE: the torch backend cannot serve it here
            return {"not_run": f"{type(exc).__name__}: {str(exc)[:160]}"}, []
        return {"backend": "torch", "same_requests": sum(a == b for a, b in zip(outputs, tokens))}, []

    out["exact_other_rounding"], _ = guarded(reference)
    return out


def run_generate_batch(model: Any, prompts: list[list[int]], warmup: list[list[int]],
                       new_tokens: int) -> dict[str, Any]:
    """transformers' paged continuous batching (its own loop thread: no inference_mode here)."""
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    device = model.device
    warm_s, _ = timed(device, lambda: model.generate_batch(inputs=warmup, generation_config=config))
    seconds, results = timed(device, lambda: model.generate_batch(inputs=prompts,
                                                                  generation_config=config))
    outputs = [r.generated_tokens for r in results.values()]
    return {"seconds": seconds, "warmup_s": warm_s, "output_tokens": sum(map(len, outputs)),
            "requests_done": len(outputs)}


def run_static_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Batched ``model.generate`` over static batches of equal-length prompts (dense KV cache), at
    the largest batch that fits: halved while it runs out of memory (a hybrid's reference chunk
    scan asks for far more than the GPU has at 128 x 256); ``not_run`` says why when none fits."""
    all_ids = torch.tensor(prompts, device=model.device)
    too_large: list[int] = []
    batch = len(prompts)
    while batch >= 1:
        def generate(n: int, ids: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0)

        def timed_batch(size: int) -> tuple[dict, list]:
            warm_s, _ = timed(model.device, lambda: generate(2, all_ids[:size]))
            seconds, outs = timed(model.device, lambda: [generate(new_tokens, chunk)
                                                         for chunk in all_ids.split(size)])
            tokens = sum(int(out[:, all_ids.shape[1]:].numel()) for out in outs)
            return {"seconds": seconds, "warmup_s": warm_s, "batch": size, "output_tokens": tokens}, []

        result, _ = guarded(lambda: timed_batch(batch))  # noqa: B023 (called here)
        if "not_run" not in result:
            return {**result, "out_of_memory_at": too_large}
        too_large.append(batch)
        batch //= 2
    return {"not_run": f"out of memory at every batch size ({', '.join(map(str, too_large))})",
            "out_of_memory_at": too_large}


def roofline(model: Any, requests: int, prompt_len: int, new_tokens: int, *, peak_tflops: float,
             hbm_tbps: float) -> dict[str, float]:
    """Output tokens/s if prefill ran at the matrix peak and each decode step read the weights
    and the KV cache once at full bandwidth."""
    config = model.config
    size = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    types = getattr(config, "layer_types", None)
    # NOTE: a hybrid's mixer layers keep a fixed-size state, not K/V per token: read and written
    # once per decode step.
    attention_layers = (config.num_hidden_layers if types is None
                        else sum(t in ("full_attention", "attention") for t in types))
    kv_per_token = attention_layers * config.num_key_value_heads * head_dim * 2 * size
    state_bytes = 0
    if types is not None and attention_layers < len(types):
        from kvcore import MambaSpec
        from kvcore.hf import specs_from_config

        specs = specs_from_config(config, dtype=next(model.parameters()).dtype).values()
        state_bytes = 2 * sum(s.real_page_size_bytes for s in specs if isinstance(s, MambaSpec))
    prefill_s = 2 * (params - embed) * requests * prompt_len / (peak_tflops * 1e12)
    decode_bytes = sum(params * size + requests * ((prompt_len + j) * kv_per_token + state_bytes)
                       for j in range(1, new_tokens))
    decode_s = decode_bytes / (hbm_tbps * 1e12)
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "tokens_per_s": requests * new_tokens / (prefill_s + decode_s), "params": params}


def run_check(args: argparse.Namespace, engine_kwargs: dict[str, Any],
              device: torch.device) -> dict[str, Any]:
    """A small float32 model's greedy tokens through kvcore against ``model.generate``'s."""
    from kvcore.hf.models import random_model

    # NOTE: cuDNN's TF32 convolutions (a hybrid's mixers) round by call shape: off for equality.
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    config = model_config(args.model, vocab=4096, hidden=512, intermediate=1024, heads=8,
                          layers=6 if args.model == "hybrid" else 4, kv_heads=2, max_pos=1024,
                          initializer_range=0.05)
    model = random_model(config, dtype=torch.float32, device=device, seed=5)
    checks = random_prompts(args.check_requests, args.check_prompt_len, 4096, 6)
    # Half the requests share a prefix, so the prefix cache serves them when it is on.
    common = random_prompts(1, 2 * args.check_prompt_len, 4096, 7)[0]
    checks += [common + q for q in checks[: max(1, len(checks) // 2)]]
    with torch.inference_mode():  # NOTE: each prompt alone, greedy: what kvcore must reproduce
        want = [model.generate(torch.tensor([q], device=device), do_sample=False,
                               max_new_tokens=args.check_new_tokens)[0, len(q):].tolist()
                for q in checks]
    # NOTE: a small token budget admits requests over several steps, so later ones hit the cache;
    # the check is of exactness, so it runs on the model-dtype cache. A hybrid's state region keeps a
    # slot and a checkpoint per sequence: 32 sequences at once.
    small_kwargs = {**engine_kwargs, "num_blocks": None, "available_memory": 1 << 30,
                    "max_num_batched_tokens": 2 * args.check_prompt_len, "kv_cache_dtype": "auto",
                    "max_num_seqs": min(engine_kwargs["max_num_seqs"], 32)}
    out = {"requests": len(checks), "new_tokens": args.check_new_tokens,
           "prompt_len": args.check_prompt_len}
    for caching in (False, True):
        result, got = guarded(lambda caching=caching: run_kvcore(
            model, checks, checks[:2], args.check_new_tokens, {**small_kwargs, "enable_prefix_caching": caching}))
        key = "prefix_caching" if caching else "plain"
        if "not_run" in result:
            out[f"{key}_not_run"] = result["not_run"]
            continue
        out[key] = sum(a == b for a, b in zip(got, want))
        out[f"{key}_hit_tokens"] = result["stats"]["prefix_cache_hit_tokens"]
    torch.backends.cudnn.allow_tf32 = tf32
    return out
