"""Write new keys and values into a layer's paged KV cache view."""

from __future__ import annotations

import torch

from kvcore_torch._checks import check_kv_write


def write_kv(
    kv_cache_view: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
) -> None:
    """Store ``key``/``value`` of each new token at its slot of ``kv_cache_view``.

    :param kv_cache_view: the layer's kernel-block view ``[B, H, N, C]`` in any
        layout (only its strides are used); K is ``view[..., :head_size]`` and
        V is ``view[..., head_size:head_size + value.shape[-1]]``.
    :param key: ``[T, H, head_size]`` in the cache's dtype.
    :param value: ``[T, H, head_size_v]`` in the cache's dtype.
    :param slot_mapping: ``[T]`` int slots ``block_id * N + offset`` in kernel
        blocks; a negative slot marks a padding token that is skipped.
    :raises ValueError: a slot beyond the cache (nothing is written).
    """
    # NOTE: one host sync (the slot range); the torch backend trades it for a clear error.
    check_kv_write(kv_cache_view, key, value, slot_mapping, head_size)
    block_size = kv_cache_view.shape[2]
    slots = slot_mapping.to(dtype=torch.int64)
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    blocks = slots // block_size
    offsets = slots % block_size
    # Advanced indices on dims 0 and 2 put the token dim first: [T, H, C].
    kv_cache_view[blocks, :, offsets, :head_size] = key
    kv_cache_view[blocks, :, offsets, head_size : head_size + value.shape[-1]] = value
