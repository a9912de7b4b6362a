"""Shared by the HF engine tests: random prompts and model.generate's greedy tokens for each alone."""

from __future__ import annotations

import torch


def prompts_for(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompts, max_new_tokens):
    return [
        model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
        for p in prompts
    ]
