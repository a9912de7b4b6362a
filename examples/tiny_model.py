"""A small random-weight GQA transformer and a dense attention reference.

The model is only a realistic source of queries, keys and values: attention
itself is a callback, so the engine can run it through a kvcore backend over
paged memory and compare each output with :func:`dense_attention` over the
same tokens kept densely.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kvcore import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

# (layer index, query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@attrs.frozen
class ModelConfig:
    """Shape of the toy model; with ``sliding_window`` every odd layer is windowed."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 32
    sliding_window: int | None = None

    def layer_name(self, index: int) -> str:
        return f"model.layers.{index}.self_attn"

    def window_of(self, index: int) -> int | None:
        return self.sliding_window if index % 2 == 1 else None

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        """What each layer stores: the input to ``KVCache.create``."""
        specs: dict[str, KVCacheSpec] = {}
        for i in range(self.num_layers):
            window = self.window_of(i)
            if window is None:
                spec = FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)
            else:
                spec = SlidingWindowSpec(
                    block_size, self.num_kv_heads, self.head_size, dtype, sliding_window=window
                )
            specs[self.layer_name(i)] = spec
        return specs


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim (split-half convention)."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class TinyTransformer:
    """Pre-norm decoder: embedding, ``num_layers`` x (GQA attention + MLP), tied head."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int = 0):
        self.config = config
        gen = torch.Generator().manual_seed(seed)
        c = config

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / rows**0.5
            return w.to(device=device, dtype=dtype)

        q_dim, kv_dim = c.num_q_heads * c.head_size, c.num_kv_heads * c.head_size
        self.embed = weight(c.vocab_size, c.hidden_size) * c.vocab_size**0.5
        self.layers = [
            {
                "qkv": weight(c.hidden_size, q_dim + 2 * kv_dim),
                "out": weight(q_dim, c.hidden_size),
                "up": weight(c.hidden_size, 2 * c.hidden_size),
                "down": weight(2 * c.hidden_size, c.hidden_size),
            }
            for _ in range(c.num_layers)
        ]
        self.scale = c.head_size**-0.5

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flattened batch of new tokens."""
        c = self.config
        q_dim, kv_dim = c.num_q_heads * c.head_size, c.num_kv_heads * c.head_size
        h = self.embed[token_ids]
        for index, w in enumerate(self.layers):
            q, k, v = (_rms_norm(h) @ w["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = _rotary(q.unflatten(-1, (c.num_q_heads, c.head_size)), positions)
            k = _rotary(k.unflatten(-1, (c.num_kv_heads, c.head_size)), positions)
            v = v.unflatten(-1, (c.num_kv_heads, c.head_size))
            h = h + self.reduce(attention(index, q, k, v).flatten(-2) @ w["out"])
            h = h + self.reduce(torch.nn.functional.gelu(_rms_norm(h) @ w["up"]) @ w["down"])
        return _rms_norm(h)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Combine a row-parallel projection's partial sums (nothing to do on one device)."""
        return partial

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.embed.float().T


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """Causal GQA attention of the last ``len(query)`` tokens of one sequence.

    ``keys``/``values`` ``[S, Hkv, D]`` hold every token of the sequence so far;
    the result ``[T, Hq, D]`` is float32.
    """
    num_q, num_k = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", query.float(), k) * scale
    q_pos = torch.arange(num_k - num_q, num_k, device=query.device)[:, None]
    k_pos = torch.arange(num_k, device=query.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)
