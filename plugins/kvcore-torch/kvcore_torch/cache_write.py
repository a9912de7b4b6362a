"""Write new keys and values into a layer's paged KV cache view."""

from __future__ import annotations

import torch

from kvcore.plugins.backend import KVQuantState
from kvcore.plugins.paged_inputs import check_kv_write, value_checks
from kvcore_torch.quant import quantize


def write_kv(
    kv_cache_view: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
    *,
    validate: bool | None = None,
    kv_quant: KVQuantState | None = None,
) -> None:
    """Store ``key``/``value`` of each new token at its slot of ``kv_cache_view``.

    :param kv_cache_view: the layer's kernel-block view ``[B, H, N, C]`` in any
        layout (only its strides are used); K is ``view[..., :head_size]`` and
        V is ``view[..., head_size:head_size + value.shape[-1]]``.
    :param key: ``[T, H, head_size]`` in the cache's dtype (quantized: any float dtype).
    :param value: ``[T, H, head_size_v]`` likewise.
    :param slot_mapping: ``[T]`` int slots ``block_id * N + offset`` in kernel
        blocks; a negative slot marks a padding token that is skipped.
    :param validate: check on the host that every slot is below ``B * N``
        (``ValueError``, nothing written). None: on for CPU tensors or under
        ``KVCORE_DEBUG_CHECKS=1``, off on GPUs (no device sync; out-of-range
        slots are then skipped, never written).
    :param kv_quant: the layer's quantization (``metadata.kv_quant``): K and V are quantized
        as :mod:`kvcore_torch.quant` says, per-token-head scales stored beside them.
    """
    num_slots = check_kv_write(
        kv_cache_view, key, value, slot_mapping, head_size,
        check_slots=value_checks(validate, kv_cache_view.device), kv_quant=kv_quant,
    )
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    block_size, head_size_v = kv_cache_view.shape[2], value.shape[-1]
    slots = slot_mapping.to(device=kv_cache_view.device, dtype=torch.int64)
    keep = (slots >= 0) & (slots < num_slots)
    # NOTE: no boolean indexing (its output size needs a device sync). A skipped
    # token repeats the write of the first kept token (same slot, same data);
    # with no kept token at all, every token writes a slot's own bytes back.
    tokens = torch.arange(num_tokens, device=slots.device)
    src = torch.where(keep, tokens, keep.to(torch.int32).argmax())
    kept = keep[src][:, None, None]
    slot = slots[src].clamp(0, num_slots - 1)
    blocks, offsets = slot // block_size, slot % block_size
    view = kv_cache_view
    if kv_quant is not None:
        (key, k_scales), (value, v_scales) = (
            quantize(x, kv_quant, s) for x, s in ((key, kv_quant.k_scale), (value, kv_quant.v_scale))
        )
        # NOTE: bytes are moved as bytes (torch.where takes no float8).
        view, key, value = (t.view(torch.uint8) for t in (view, key, value))
        if k_scales is not None:
            _put(kv_quant.scale_cache, blocks, offsets, slice(None), kept, torch.stack((k_scales, v_scales), -1)[src])
    _put(view, blocks, offsets, slice(None, head_size), kept, key[src])
    _put(view, blocks, offsets, slice(head_size, head_size + head_size_v), kept, value[src])


def _put(view: torch.Tensor, blocks, offsets, columns: slice, kept: torch.Tensor, rows: torch.Tensor) -> None:
    """``view[blocks, :, offsets, columns] = rows`` where ``kept``, else the old bytes again."""
    # Advanced indices on dims 0 and 2 put the token dim first: [T, H, C].
    old = view[blocks, :, offsets, columns]
    view[blocks, :, offsets, columns] = torch.where(kept, rows, old)
