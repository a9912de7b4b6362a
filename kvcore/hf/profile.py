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


def cache_share(free: int, peak: int, num_tokens: int) -> int:
    """Bytes for the KV cache: 90% of ``free - peak - MARGIN``, or an error naming the remedy."""
    share = int((free - peak - MARGIN) * 0.9)
    if share <= 0:
        raise InsufficientMemoryError(
            f"a step of {num_tokens} tokens (max_num_batched_tokens) needs {peak / 2**30:.2f} GiB and the GPU has "
            f"{free / 2**30:.2f} GiB free: none is left for the KV cache; lower max_num_batched_tokens, free GPU "
            "memory, or pass available_memory / num_blocks")
    return share


def step_peak(model: Any, num_tokens: int, num_logits: int, mixers: MixerRunner | None) -> int:
    """Peak bytes a forward of one ``num_tokens``-token sequence allocates beyond those allocated now
    (attention through SDPA, mixers through their backends on zero states, ``num_logits`` logits)."""
    device, previous, why = model.device, model.config._attn_implementation, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        model.set_attn_implementation("sdpa")
        with contextlib.ExitStack() as routed, torch.inference_mode():
            if mixers is not None:
                routed.enter_context(mixers.installed())
                routed.enter_context(mixers.scratch())
            ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=num_logits)
    except torch.OutOfMemoryError as exc:  # NOTE: reported below, once the step's memory is freed
        why = str(exc).splitlines()[0]
    finally:
        model.set_attn_implementation(previous)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    if why is not None:
        raise InsufficientMemoryError(f"one step of {num_tokens} tokens (max_num_batched_tokens) does not fit in "
                                      f"the GPU's free memory ({why}); lower max_num_batched_tokens")
    return peak
