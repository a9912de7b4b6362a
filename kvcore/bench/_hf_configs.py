"""The random models ``kvcore bench hf`` serves: a Llama, or a Granite-4.0-H-like hybrid.

The hybrid follows IBM Granite 4.0-H's dense ("H-Micro") shape at the
benchmark's size: GraniteMoeHybrid decoder layers, mostly Mamba2 mixers
(heads of 64, state 128, one group, a 4-wide convolution) with one attention
layer in every eight, a dense shared MLP, no position embedding in attention.
This module imports transformers: ``kvcore bench hf`` loads it only when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

import transformers

#: ``--model`` choices.
BENCH_MODELS = ("llama", "hybrid")


def _granite_hybrid(*, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                    max_pos: int, **extra: Any) -> transformers.PretrainedConfig:
    layer_types = ["attention" if i % 8 == 4 else "mamba" for i in range(layers)]
    if "attention" not in layer_types:
        layer_types[-1] = "attention"
    return transformers.GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, shared_intermediate_size=intermediate,
        num_local_experts=0, num_hidden_layers=layers, layer_types=layer_types, num_attention_heads=heads,
        num_key_value_heads=kv_heads, mamba_n_heads=2 * hidden // 64, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
        position_embedding_type="nope", max_position_embeddings=max_pos, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, **extra,
    )


def bench_config(args: argparse.Namespace, max_pos: int) -> transformers.PretrainedConfig:
    """The timed model's config, from ``--model`` and the size flags."""
    sizes = dict(vocab=args.vocab, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                 heads=args.heads, kv_heads=args.kv_heads, max_pos=max_pos)
    if getattr(args, "model", "llama") == "hybrid":
        return _granite_hybrid(**sizes)
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_pos, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )


def check_config(model: str) -> transformers.PretrainedConfig:
    """The smaller float32 model whose greedy tokens must equal ``model.generate``'s."""
    if model == "hybrid":
        return _granite_hybrid(vocab=4096, hidden=512, intermediate=1024, layers=6, heads=8, kv_heads=2,
                               max_pos=1024, initializer_range=0.05)
    return transformers.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0,
    )
