"""Lay out a small KV cache by hand in every layout; print its strides and one layer's view.

Run: python examples/quickstart.py

The cache is logically [L, B, H, N, C]: 4 layers, 32 blocks, 8 KV heads, 16
tokens per block, 256 values per (head, token) (K then V, 128 each, bf16). A
layout only changes the order in memory, so each dimension's stride (how far
apart two neighbours are) changes with it.
"""

import torch

from kvcore import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    allocate_kv_cache,
    compute_layout_strides,
)

spec = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
layers = [f"model.layers.{i}.attn" for i in range(4)]
num_blocks = 32
DIMS = ("layer", "block", "head", "token", "value")
dtype = str(spec.dtype).removeprefix("torch.")
print(f"{len(layers)} layers x {num_blocks} blocks x {spec.num_kv_heads} heads x {spec.block_size} tokens "
      f"x {2 * spec.head_size} values (K then V, {dtype})")
print(f"one block of one layer: {spec.page_size_bytes:,} bytes")
for layout in KVCacheLayout:
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    tensor = KVCacheTensor(
        size=num_blocks * len(layers) * spec.page_size_bytes,
        layers=layers,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    config = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec(layers, spec)], layout)
    views = allocate_kv_cache(config, "cpu")
    view = views[layers[1]]
    order = ", ".join(DIMS["LBHNC".index(d)] for d in layout.name)
    print(f"\n{layout.name}: in memory, outermost first: {order}")
    # NOTE: the layout's C dim counts bytes; the next value is one element (2 bytes of bf16) away.
    byte_strides = [*strides[:4], strides[4] * spec.dtype.itemsize]
    print("  to the next  " + "".join(f"{d:>11}" for d in DIMS))
    print("  bytes        " + "".join(f"{s:>11,}" for s in byte_strides))
    print("  elements     " + f"{'-':>11}" + "".join(f"{s:>11,}" for s in view.stride()))
    shape = " x ".join(str(n) for n in view.shape) + f" {dtype}"
    print(f"  layer 1's view [block, head, token, value]: {shape}")
