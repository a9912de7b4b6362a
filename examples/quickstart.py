"""Lay out a small KV cache by hand in every layout; print the strides and one layer's view.

Run: python examples/quickstart.py
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
    print(
        f"{layout.name}: byte strides [L,B,H,N,C]={strides}  "
        f"layer view {tuple(view.shape)} {view.dtype} strides={view.stride()}"
    )
