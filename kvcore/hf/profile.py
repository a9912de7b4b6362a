"""An engine's default KV cache size on a GPU: the free memory left beside the largest step it will
run, measured by one forward of the step budget before the cache exists (as vLLM's profile run)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvcore.errors import InsufficientMemoryError
from kvcore.hf.mixers import MixerRunner

#: Bytes left free beside the cache and the largest step (CUDA graphs, kernels' workspaces).
MARGIN = 1 << 30
#: Share of the rest the cache takes.
UTILIZATION = 0.9


def cache_share(free: int, peak: int, num_tokens: int) -> int:
    """Bytes for the KV cache: ``(free - peak - MARGIN) * UTILIZATION``, or an error naming the remedy."""
    share = int((free - peak - MARGIN) * UTILIZATION)
    if share <= 0:
        raise InsufficientMemoryError(
            f"a step of {num_tokens} tokens (max_num_batched_tokens) needs {peak / 2**30:.2f} GiB of "
            f"activations and the GPU has {free / 2**30:.2f} GiB free: no room is left for the KV cache; "
            "lower max_num_batched_tokens, free GPU memory, or pass available_memory / num_blocks"
        )
    return share


def step_peak(model: Any, num_tokens: int, num_logits: int, mixers: MixerRunner | None) -> int:
    """Peak bytes one forward of ``num_tokens`` tokens of one sequence allocates beyond what is
    allocated now (attention through SDPA, a hybrid's mixers through their backends on zero
    states), ``num_logits`` rows of logits kept."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    previous = model.config._attn_implementation
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    try:
        model.set_attn_implementation("sdpa")
        routed = contextlib.ExitStack()
        if mixers is not None:
            routed.enter_context(mixers.installed())
            routed.enter_context(mixers.scratch())
        with routed, torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=num_logits)
    except torch.OutOfMemoryError as exc:
        why = str(exc).splitlines()[0]
    else:
        why = None
    finally:
        model.set_attn_implementation(previous)
    del ids
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    if why is not None:
        raise InsufficientMemoryError(
            f"one step of {num_tokens} tokens (max_num_batched_tokens) does not fit in the GPU's free memory "
            f"({why}); lower max_num_batched_tokens or free GPU memory"
        )
    return peak


def default_cache_memory(model: Any, num_tokens: int, num_logits: int, mixers: MixerRunner | None) -> int:
    """The engine's default ``available_memory``: on a GPU, what :func:`cache_share` leaves beside
    :func:`step_peak`; elsewhere 256 MiB."""
    device = torch.device(model.device)
    if device.type != "cuda":
        return 256 << 20
    peak = step_peak(model, num_tokens, num_logits, mixers)
    return cache_share(torch.cuda.mem_get_info(device)[0], peak, num_tokens)
