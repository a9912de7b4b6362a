"""The zeroer invariant on random planned models (hypothesis, bounded and derandomized).

Invariant, in words: for any model kvcore plans — full, sliding-window, MLA,
compressed and Mamba layers, in every layout, with dense groups split into
kernel blocks at allocation and packed compressed groups read through kernel
views — zeroing a list of manager block ids clears exactly the bytes of those
blocks in every attention and state view, and no other byte of the allocation.

The expected bytes come from masks built in plain torch over the views as
allocated (never from the zeroer's segments), on buffers of random non-zero
bytes. Both constructors are checked: ``KVBlockZeroer.from_views`` (views plus
rows per manager block) and the seed's (attention groups, kernel block sizes,
kernel views). The Triton kernel runs through ``TRITON_INTERPRET=1``; without
it the torch fallback is checked.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.backend import AttentionBackend
from kvcore.runtime.attn_group import AttentionGroup
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import AttentionSpec, FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

BACKEND = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
DTYPES = [torch.bfloat16, torch.float32]


class _Backend(AttentionBackend):
    name = "zeroer-property"

    @staticmethod
    def forward(*args, **kwargs):  # pragma: no cover - never called: the zeroer reads no backend
        raise NotImplementedError


@st.composite
def layer_specs(draw, block_size: int):
    kind = draw(st.sampled_from(["full", "sliding", "mla", "mamba", "compressed"]))
    dtype = draw(st.sampled_from(DTYPES))
    heads, head = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 8]))
    if kind == "mamba":
        return MambaSpec(block_size, [(draw(st.integers(1, 3)), 4), (2 * draw(st.integers(1, 3)),)], [dtype, dtype])
    if kind == "mla":
        return MLAAttentionSpec(block_size, 1, head, dtype)
    if kind == "compressed":
        return FullAttentionSpec(block_size, 1, head, dtype, tokens_per_state=4)
    if kind == "sliding":
        return SlidingWindowSpec(block_size, heads, head, dtype, sliding_window=8)
    return FullAttentionSpec(block_size, heads, head, dtype)


@st.composite
def models(draw):
    """A planned model: 1-3 kinds of layer, 1-3 identical layers of each, in a random layout."""
    block_size = draw(st.sampled_from([8, 16]))
    specs = {}
    for kind in range(draw(st.integers(1, 3))):
        spec = draw(layer_specs(block_size))
        specs.update((f"k{kind}.l{i}", spec) for i in range(draw(st.integers(1, 3))))
    num_blocks = draw(st.integers(2, 6))
    config = None
    for layout in (draw(st.sampled_from(list(KVCacheLayout))), KVCacheLayout.BLNHC):
        try:
            config = plan_kv_cache(specs, layout, num_blocks=num_blocks)
            break
        except ValueError:
            continue  # a layout that cannot hold these mixed pages (the planner says so): a block-compact one can
    assume(config is not None)
    return config, draw(st.data())


def _kernel_sizes(config, data):
    """Per group: a kernel block size (dense split at allocation, packed kernel view) or None."""
    sizes, packed = [], []
    for group, tensor in zip(config.kv_cache_groups, config.kv_cache_tensors):
        spec = group.kv_cache_spec
        choice = None
        if isinstance(spec, AttentionSpec) and spec.page_size_padded is None:
            split = [spec.block_size // r for r in (2, 4) if spec.block_size // r >= max(1, spec.tokens_per_state)]
            choice = data.draw(st.sampled_from([None, *split]))
        dense = tensor.block_stride == spec.real_page_size_bytes
        if choice is not None and not dense and spec.tokens_per_state > 1:
            packed.append(True)
        else:
            packed.append(False)
            choice = choice if dense else None
        sizes.append(choice)
    return sizes, packed


def _mask(nbytes: int, views: dict, ids: list[int]) -> torch.Tensor:
    mask = torch.zeros(nbytes, dtype=torch.bool)
    for view, rows in views.values():
        as_bytes = view.view(torch.uint8)
        manager = as_bytes.unflatten(0, (as_bytes.shape[0] // rows, rows))
        marks = mask.as_strided(manager.shape, manager.stride(), view.data_ptr() - view.untyped_storage().data_ptr())
        for block in ids:
            marks[block] = True
    return mask


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much])
@given(models())
def test_zeroing_clears_exactly_the_listed_blocks_of_every_view(model):
    config, data = model
    sizes, packed = _kernel_sizes(config, data)
    alloc_sizes = [None if p else k for k, p in zip(sizes, packed)]
    event(f"layout {config.layout.name}")
    for gid, group in enumerate(config.kv_cache_groups):
        split = "packed split" if packed[gid] else "dense split" if sizes[gid] else "whole blocks"
        event(f"{type(group.kv_cache_spec).__name__}: {split}")
    kv = allocate_kv_cache(config, "cpu", kernel_block_sizes=alloc_sizes)
    views, groups, kernel_views = {}, [], {}
    for gid, group in enumerate(config.kv_cache_groups):
        spec, k = group.kv_cache_spec, sizes[gid]
        ratio = 1 if k is None or packed[gid] else spec.block_size // k
        attn = AttentionGroup(_Backend, group.layer_names, spec, gid, kernel_block_size=k)
        groups.append(attn)
        for name in group.layer_names:
            views[name] = (kv[name], ratio)
            kernel_views[name] = attn.map_kv_cache_to_kernel_blocks(kv[name]) if packed[gid] else kv[name]
    raw = torch.empty(0, dtype=torch.uint8).set_(next(iter(kv.values())).untyped_storage())
    ids = data.draw(st.lists(st.integers(0, config.num_blocks - 1), max_size=2 * config.num_blocks))
    expected_mask = _mask(raw.numel(), views, ids)
    zeroers = [
        KVBlockZeroer.from_views("cpu", views, config.num_blocks, backend=BACKEND),
        KVBlockZeroer("cpu", groups, [k or g.kv_cache_spec.block_size for k, g in zip(sizes, config.kv_cache_groups)],
                      kernel_views, config.num_blocks, backend=BACKEND),
    ]
    for seed, zeroer in enumerate(zeroers):
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(1, 256, raw.shape, generator=gen, dtype=torch.uint8))
        before = raw.clone()
        zeroer.zero_block_ids(ids)
        assert torch.equal(raw[expected_mask], torch.zeros_like(raw[expected_mask])), "a listed byte survived"
        assert torch.equal(raw[~expected_mask], before[~expected_mask]), "a byte outside the listed blocks changed"
        for gid, is_packed in enumerate(packed):
            if not is_packed:
                continue
            # Kernel block j of manager block b is row b * stride + j of the kernel view: zero too.
            stride = groups[gid].kernel_block_stride
            per_block = config.kv_cache_groups[gid].kv_cache_spec.block_size // sizes[gid]
            for name in config.kv_cache_groups[gid].layer_names:
                for b in ids:
                    rows = kernel_views[name][b * stride : b * stride + per_block]
                    assert not rows.view(torch.uint8).any(), f"{name}: a kernel block of block {b} kept bytes"
