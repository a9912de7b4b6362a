"""The engines ``kvcore bench hf`` compares, each timed on the same model and requests.

Every runner does one untimed warm-up pass (kernel compilation, CUDA graph
capture, allocator growth) and then times one full pass, with the device
synchronized at both ends. Output tokens are counted from what each engine
returned. This module imports transformers: ``kvcore bench hf`` loads it
only when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig

from kvcore.hf import Engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def stats_delta(after: Any, before: Any) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def run_kvcore(model: Any, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int,
               engine_kwargs: dict[str, Any], *, profile: bool = False) -> dict[str, Any]:
    """kvcore.hf.Engine: warm up on ``warmup``, then time ``prompts``; optionally a synced pass."""
    start = time.perf_counter()
    engine = Engine(model, **engine_kwargs)
    build_s = time.perf_counter() - start
    warm_s, _ = timed(engine.device, lambda: engine.generate(warmup, new_tokens))
    before = engine.stats()
    seconds, outputs = timed(engine.device, lambda: engine.generate(prompts, new_tokens))
    result = {
        "seconds": seconds, "warmup_s": warm_s, "build_s": build_s, "outputs": outputs,
        "output_tokens": sum(len(o) for o in outputs), "stats": stats_delta(engine.stats(), before),
        "num_blocks": engine.kv.num_blocks, "layout": engine.kv.layout.name,
        "kernel_block_sizes": list(engine.kv.kernel_block_sizes),
        "backend": next(iter(engine._layers.values())).backend.get_name(),  # an attention layer's
        # Same-sized first and second generate: 1.0 when the first pays no compilation or capture.
        "first_vs_second": seconds / warm_s if warm_s else None,
    }
    if profile:
        engine.sync_timing = True
        before = engine.stats()
        result["profile_s"], _ = timed(engine.device, lambda: engine.generate(prompts, new_tokens))
        result["profile"] = stats_delta(engine.stats(), before)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_generate_batch(model: Any, prompts: list[list[int]], warmup: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers' paged continuous batching (it runs its own loop thread: no inference_mode here)."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    device = model.device
    warm_s, _ = timed(device, lambda: model.generate_batch(inputs=warmup, generation_config=config))
    seconds, results = timed(device, lambda: model.generate_batch(inputs=prompts, generation_config=config))
    outputs = [r.generated_tokens for r in results.values()]
    return {"seconds": seconds, "warmup_s": warm_s, "output_tokens": sum(len(o) for o in outputs),
            "requests_done": len(outputs)}


def run_static_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Batched ``model.generate``: one static batch of equal-length prompts, dense KV cache."""
    device = model.device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)

    warm_s, _ = timed(device, lambda: generate(2))
    seconds, out = timed(device, lambda: generate(new_tokens))
    return {"seconds": seconds, "warmup_s": warm_s, "output_tokens": int(out[:, ids.shape[1]:].numel())}


def run_reference(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``model.generate`` on each prompt alone (greedy): the tokens kvcore must reproduce."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out.append(model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist())
    return out


def roofline(model: Any, requests: int, prompt_len: int, new_tokens: int, *, peak_tflops: float,
             hbm_tbps: float) -> dict[str, float]:
    """Output tokens/s if prefill ran at the matrix peak and every decode step read weights and KV once."""
    config = model.config
    size = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    types = getattr(config, "layer_types", None)
    # NOTE: a hybrid's mixer layers keep a fixed-size state, not K/V per token.
    attention_layers = config.num_hidden_layers if types is None else sum(t == "full_attention" for t in types)
    kv_per_token = attention_layers * config.num_key_value_heads * head_dim * 2 * size
    prefill_s = 2 * (params - embed) * requests * prompt_len / (peak_tflops * 1e12)
    decode_bytes = sum(params * size + requests * (prompt_len + j) * kv_per_token for j in range(1, new_tokens))
    decode_s = decode_bytes / (hbm_tbps * 1e12)
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "tokens_per_s": requests * new_tokens / (prefill_s + decode_s), "params": params}
