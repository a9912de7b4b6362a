"""Write new keys and values into a layer's paged KV cache view."""

from __future__ import annotations

import torch

from kvcore_torch._checks import check_cache_view, check_index, check_tokens


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
    head_size_v = value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() == 3 else None
    check_cache_view(kv_cache_view, head_size, head_size_v)
    check_index("slot_mapping", slot_mapping, 1, kv_cache_view)
    num_tokens = slot_mapping.shape[0]
    num_blocks, num_heads, block_size, _ = kv_cache_view.shape
    check_tokens("key", key, num_tokens, num_heads, head_size, kv_cache_view)
    check_tokens("value", value, num_tokens, num_heads, value.shape[-1], kv_cache_view)
    num_slots = num_blocks * block_size
    slots = slot_mapping.to(device=kv_cache_view.device, dtype=torch.int64)
    # NOTE: one host sync; the torch backend trades it for a clear error.
    if num_tokens and int(slots.max()) >= num_slots:
        bad = int(slots.max())
        raise ValueError(
            f"slot_mapping holds slot {bad} but the cache has {num_slots} slots "
            f"({num_blocks} blocks of {block_size}); map block ids to kernel blocks first"
        )
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    blocks = slots // block_size
    offsets = slots % block_size
    # Advanced indices on dims 0 and 2 put the token dim first: [T, H, C].
    kv_cache_view[blocks, :, offsets, :head_size] = key
    kv_cache_view[blocks, :, offsets, head_size : head_size + value.shape[-1]] = value
