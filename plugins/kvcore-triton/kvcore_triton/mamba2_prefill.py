"""Mamba2 prefill for a batch of equal-length chunks, continued from each sequence's slot: the
module's projections and norm around the causal convolution and the chunked state-space scan,
written as matrix products.

transformers' reference scan (without the ``mamba_ssm`` kernels) multiplies out ``[chunk, chunk,
heads, state]`` tensors per chunk before reducing them: 2 GiB per 256-token chunk at a
Granite-4.0-H-like shape, and as slow as that much memory traffic. Here the same sums are batched
matrix products over the heads' groups, so memory and time grow with the tokens (a few MiB per
chunk). The within-chunk weights come from one Triton kernel (scan_kernels.py). A float32 model
keeps float32 products throughout, its convolution a sum of shifted products (no cuDNN, no TF32);
a 16-bit model's convolution is the module's depthwise one, and its largest scan product runs in
its own dtype on tensor cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvcore_triton.norm_kernels import gated_norm
from kvcore_triton.scan_kernels import decayed_scores, runs_on, scan_dt

#: Attributes of transformers' Mamba2 mixers (Bamba, GraniteMoeHybrid, FalconH1, NemotronH) read here.
MAMBA2 = ("in_proj", "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias", "intermediate_size", "conv_dim",
          "num_heads", "head_dim", "n_groups", "ssm_state_size", "activation", "chunk_size")


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T, T]``: entry ``[i, j]`` sums ``x[j + 1 .. i]``, -inf above the diagonal."""
    size = x.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1)
    sums = x[..., None].expand(*x.shape, size).masked_fill(~below, 0).cumsum(dim=-2)
    return sums.masked_fill(~below.logical_or(torch.eye(size, dtype=torch.bool, device=x.device)), -torch.inf)


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, initial: torch.Tensor, chunk_size: int,
               at: Sequence[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's scan of ``x`` ``[k, T, H, P]`` from the states ``initial`` ``[k, H, P, N]`` (float32):
    ``dt`` ``[k, T, H]`` (after softplus), ``a`` ``[H]`` (negative), ``b``, ``c`` ``[k, T, G, N]``,
    ``d`` ``[H]``. Returns ``y`` ``[k, T, H, P]`` and the final states (both float32); with ``at``
    (``m`` pairs of a row and a token count ``1..T``) the states are instead ``[m, H, P, N]``, those
    of each listed row after its first that many tokens (free where they fall on chunk boundaries).

    Sums run in float32. A 16-bit ``x`` (a 16-bit model's) multiplies the within-chunk weights in
    its own dtype on tensor cores (Mamba2's own kernels also multiply in the model's dtype), that
    product rounded to the dtype once; float32 keeps float32 products."""
    k, length, heads, p = x.shape
    groups, n = b.shape[2:]
    size = min(chunk_size, length)  # NOTE: a short piece is one chunk of its own length (no padding)
    pad = -length % size
    products = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    x = x.float()
    residual = x * d.float()[:, None]
    x = x * dt[..., None].float()
    adt = a.float() * dt.float()

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t
        return t.view(k, -1, size, *t.shape[2:])

    x, adt, b, c = chunks(x), chunks(adt), chunks(b.float()), chunks(c.float())
    num = x.shape[1]
    per = heads // groups
    # 1. within each chunk: y_i = sum_{j <= i} (c_i . b_j) exp(A-sum of j+1..i) x_j dt_j
    scores = torch.matmul(c.transpose(2, 3), b.permute(0, 1, 3, 4, 2))  # [k, chunks, G, size, size]
    if runs_on(x.device):
        weights = decayed_scores(scores.reshape(k * num, groups, size, size),
                                 adt.transpose(2, 3).reshape(k * num, heads, size), products)
    else:
        weights = scores.repeat_interleave(per, dim=2) * torch.exp(segment_sum(adt.permute(0, 1, 3, 2)))
    weights = weights.view(k, num, heads, size, size).to(products)
    y = torch.matmul(weights, x.transpose(2, 3).to(products)).transpose(2, 3)  # [k, chunks, size, H, P]
    adt = adt.permute(0, 3, 1, 2)
    cumsum = adt.cumsum(-1)  # [k, H, chunks, size]
    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(cumsum[..., -1:] - cumsum).permute(0, 2, 3, 1)[..., None]  # [k, chunks, size, H, 1]
    grouped = (x * to_end).view(k, num, size, groups, per * p).permute(0, 1, 3, 4, 2)  # [k, chunks, G, per P, size]
    own = torch.matmul(grouped, b.transpose(2, 3)).reshape(k, num, heads, p, n)
    # 3. the state entering every chunk, from the initial state on: one chunk after the other
    through = torch.exp(cumsum[..., -1])[..., None, None]  # [k, H, chunks, 1, 1]
    state, entering = initial.float(), []
    for i in range(num):
        entering.append(state)
        state = torch.addcmul(own[:, i], state, through[:, :, i])
    # NOTE: [k, chunks (+ 1), H, P, N]: the state entering every chunk (then the final one, to pick from)
    boundary = torch.stack([*entering, state] if at else entering, 1)
    states, final = boundary[:, :num], state  # [k, chunks, H, P, N], [k, H, P, N]
    # 4. what the state entering each chunk gives its tokens
    off = torch.matmul(c.transpose(2, 3), states.view(k, num, groups, per * p, n).transpose(3, 4))
    off = off.transpose(2, 3).reshape(k, num, size, heads, p)
    y = torch.addcmul(y.float(), off, torch.exp(cumsum).permute(0, 2, 3, 1)[..., None])
    y = y.reshape(k, -1, heads, p)[:, :length] + residual
    if not at:
        return y, final
    if all(t == length or t % size == 0 for _, t in at):  # NOTE: the states entering chunks, and the last
        picks = torch.tensor([(row, num if t == length else t // size) for row, t in at], dtype=torch.long)
        picks = picks.to(x.device, non_blocking=True)
        return y, boundary[picks[:, 0], picks[:, 1]]
    # 5. states part-way into a chunk: the state entering it decayed to there, plus its tokens so far
    rows, tokens = torch.tensor(list(at), dtype=torch.long).to(x.device, non_blocking=True).unbind(1)
    chunk, last = (tokens - 1) // size, (tokens - 1) % size
    sums = cumsum[rows, :, chunk]  # [m, H, size]
    upto = sums.gather(-1, last[:, None, None].expand(-1, heads, 1))  # [m, H, 1]
    passed = torch.arange(size, device=x.device) <= last[:, None]  # [m, size]
    weights = torch.exp((upto - sums).masked_fill(~passed[:, None], -torch.inf)).transpose(1, 2)  # [m, size, H]
    picked = (x[rows, chunk] * weights[..., None]).view(len(rows), size, groups, per, p)
    own = torch.einsum("mlgn,mlgjp->mgjpn", b[rows, chunk], picked).reshape(len(rows), heads, p, n)
    return y, torch.exp(upto)[..., None] * states[rows, chunk] + own


def causal_conv(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution of ``x`` ``[k, n, C]`` continuing the windows ``window``
    ``[k, C, K]`` (weight ``[C, K]``): the activated output ``[k, n, C]`` and the inputs ``[k, C, K + n]``
    (old window, then ``x``) whose last ``K`` columns are the new windows."""
    kernel, n = weight.shape[-1], x.shape[1]
    full = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [k, C, K + n]
    sixteen = x.dtype == weight.dtype and x.dtype in (torch.float16, torch.bfloat16)
    if sixteen and (bias is None or bias.dtype == x.dtype):  # NOTE: as the module's own
        out = F.conv1d(full[..., 1:], weight[:, None], bias, groups=weight.shape[0])
    else:  # NOTE: float32 products stay float32 (a cuDNN convolution may round through TF32)
        acc = full[..., 1 : 1 + n].float() * weight[:, :1].float()
        for j in range(1, kernel):
            acc += full[..., 1 + j : 1 + j + n].float() * weight[:, j : j + 1].float()
        if bias is not None:
            acc += bias.float()[:, None]
        out = acc.to(weight.dtype)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype).transpose(1, 2), full


def step_sizes(dt: torch.Tensor, bias: torch.Tensor, limit: tuple[float, float] | None,
               lengths: torch.Tensor | None) -> torch.Tensor:
    """``softplus(dt + bias)``, clamped to ``limit`` (rows of one token excepted) and 0 past each row's
    ``lengths``: for a 16-bit ``dt`` one kernel where Triton runs (:func:`scan_dt`), else PyTorch ops
    (a float32 model's step sizes stay PyTorch's to the last bit: its tokens equal transformers')."""
    if dt.dtype in (torch.float16, torch.bfloat16) and runs_on(dt.device) and dt.stride(-1) == 1:
        return scan_dt(dt, bias, limit, lengths)
    dt = F.softplus(dt + bias.to(dt.dtype))
    if limit is not None:
        clamped = torch.clamp(dt, min=limit[0], max=limit[1])
        dt = clamped if lengths is None else torch.where((lengths > 1)[:, None, None], clamped, dt)
    if lengths is not None:
        dt = dt.masked_fill((torch.arange(dt.shape[1], device=dt.device) >= lengths[:, None])[..., None], 0.0)
    return dt


def mamba2_prefill(layer: Any, x: torch.Tensor, states: Sequence[torch.Tensor], rows: slice | torch.Tensor,
                   checkpoints: Sequence[Sequence[tuple[int, int]]] = (), *,
                   lengths: Sequence[int] | None = None) -> torch.Tensor:
    """``layer``'s output for ``x`` ``[k, n, hidden]``, continuing from (and updating) the states at
    ``rows`` of ``states`` (recurrent ``[slots, H, P, N]``, conv window ``[slots, C, K]``); with
    ``checkpoints``, row ``i``'s states after its first ``tokens`` tokens also go to ``slot`` for
    each ``(tokens, slot)`` of ``checkpoints[i]``, from the same scan. With ``lengths`` row ``i``
    ends after ``lengths[i]`` tokens (its checkpoints too): its padding scans with ``dt = 0``,
    which neither decays the state nor adds to it, and its states are those at its end."""
    recurrent, conv = states
    k, n, _ = x.shape
    ends = [n] * k if lengths is None else list(lengths)
    dtype = x.dtype
    multiplier = getattr(layer, "ssm_in_multiplier", None)  # NOTE: FalconH1's muP scales
    projected = layer.in_proj(x if multiplier is None else x * multiplier)
    mup = getattr(layer, "mup_vector", None)
    if mup is not None:
        projected = projected * mup
    inner, groups, size, heads = layer.intermediate_size, layer.n_groups, layer.ssm_state_size, layer.num_heads
    gate, xbc, dt = projected.split([inner, layer.conv_dim, heads], dim=-1)
    xbc, inputs = causal_conv(conv[rows], xbc, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.activation)
    hidden, b, c = xbc.split([inner, groups * size, groups * size], dim=-1)
    # NOTE: as transformers, whose one-token step (its recurrent form) leaves dt unclamped
    limit = tuple(getattr(layer, "time_step_limit", (0.0, float("inf")))) if n > 1 else None
    tokens = None if lengths is None else torch.tensor(ends, dtype=torch.long).to(x.device, non_blocking=True)
    dt = step_sizes(dt, layer.dt_bias, limit, tokens)
    # NOTE: a checkpoint at a row's end is its final state (a padded row's state stays there)
    kept = [(i, n if t == ends[i] else t, t, slot) for i, row in enumerate(checkpoints) for t, slot in row]
    chunk = layer.chunk_size
    if kept:  # NOTE: scan chunks that end on the checkpoints, where the states come for free
        spacing = math.gcd(chunk, *(at for _, at, _, _ in kept if at != n))
        # (not below 64 tokens: the boundary states, 2 MiB a chunk at a Granite-4.0-H shape, would
        # outgrow the activations the engine measured for its step budget)
        chunk = spacing if spacing >= min(chunk, 64) else chunk
    y, found = chunk_scan(hidden.reshape(k, n, heads, layer.head_dim), dt, -torch.exp(layer.A_log.float()),
                          b.reshape(k, n, groups, size), c.reshape(k, n, groups, size), layer.D, recurrent[rows],
                          chunk, at=[(i, at) for i, at, _, _ in kept] + [(i, n) for i in range(k)] if kept else ())
    kernel = conv.shape[-1]
    if kept:  # NOTE: the conv window after t tokens: the K inputs ending there, gathered in one index
        picks = torch.tensor([(slot, i, t) for i, _, t, slot in kept], dtype=torch.long).to(x.device,
                                                                                            non_blocking=True)
        recurrent[picks[:, 0]] = found[: len(kept)].to(recurrent.dtype)
        conv[picks[:, 0]] = inputs.unfold(2, kernel, 1)[picks[:, 1], :, picks[:, 2]].to(conv.dtype)
        found = found[len(kept) :]
    recurrent[rows] = found.to(recurrent.dtype)
    if lengths is None:
        conv[rows] = inputs[..., -kernel:].to(conv.dtype)
    else:  # NOTE: the K inputs ending at each row's last token
        last = (tokens[:, None] + torch.arange(kernel, device=x.device))[:, None].expand(k, inputs.shape[1], kernel)
        conv[rows] = inputs.gather(2, last).to(conv.dtype)
    y = y.reshape(k, n, inner)
    y = gated_norm(layer.norm, y, gate) if getattr(layer, "mamba_rms_norm", True) else y * F.silu(gate)
    return layer.out_proj(y.to(dtype))
