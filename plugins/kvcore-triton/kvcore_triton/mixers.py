"""The ``triton-mixer`` backend: Mamba2 and short-convolution decode steps for a whole batch in
a few launches (the module's projections and norm, then the slot-indexed state kernels); Mamba2
prefill as batched matrix products (mamba2_prefill.py); other prefill chunks and modules it does
not recognise go to the torch reference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvcore.plugins.mixer_backend import MixerBackend
from kvcore_torch.mixers import TorchMixerBackend
from kvcore_triton.mamba2_prefill import MAMBA2, mamba2_prefill
from kvcore_triton.mixer_kernels import ACTIVATIONS, causal_conv1d_update, selective_state_update
from kvcore_triton.norm_kernels import gated_norm

#: And of LFM2's short convolution.
_SHORT_CONV = ("in_proj", "conv", "out_proj")


def _mamba2_decode(layer: Any, x: torch.Tensor, states: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    recurrent, conv = states
    rows, dtype = x.shape[0], x.dtype
    multiplier = getattr(layer, "ssm_in_multiplier", None)  # NOTE: FalconH1's muP scales
    projected = layer.in_proj(x if multiplier is None else x * multiplier)
    mup = getattr(layer, "mup_vector", None)
    if mup is not None:
        projected = projected * mup.reshape(-1)
    inner, groups, size = layer.intermediate_size, layer.n_groups, layer.ssm_state_size
    gate, xbc, dt = projected.split([inner, layer.conv_dim, layer.num_heads], dim=-1)
    # NOTE: slot values are checked on CPU tensors only: no environment read, no sync per step on a GPU
    check = slots.device.type == "cpu"
    xbc = causal_conv1d_update(xbc, conv, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, slots,
                               activation=layer.activation, validate=check)
    hidden, b, c = xbc.split([inner, groups * size, groups * size], dim=-1)
    normed = getattr(layer, "mamba_rms_norm", True)  # NOTE: FalconH1 without its norm gates in the scan
    y = selective_state_update(
        recurrent, hidden.view(rows, layer.num_heads, layer.head_dim), dt, layer.A_log,
        b.view(rows, groups, size), c.view(rows, groups, size), layer.D, layer.dt_bias, slots,
        z=None if normed else gate.reshape(rows, layer.num_heads, layer.head_dim), validate=check,
    ).view(rows, 1, inner)
    if normed:
        y = gated_norm(layer.norm, y, gate.unsqueeze(1))
    return layer.out_proj(y.to(dtype))[:, 0]


def _short_conv_decode(layer: Any, x: torch.Tensor, states: Sequence[torch.Tensor], slots: torch.Tensor
                       ) -> torch.Tensor:
    b, c, hidden = layer.in_proj(x).chunk(3, dim=-1)
    conv = layer.conv
    y = causal_conv1d_update(b * hidden, states[0], conv.weight.squeeze(1), conv.bias, slots,
                             validate=slots.device.type == "cpu")
    return layer.out_proj(c * y)


def _is_mamba2(layer: Any, states: Sequence[torch.Tensor]) -> bool:
    return len(states) == 2 and all(hasattr(layer, a) for a in MAMBA2) and layer.activation in ACTIVATIONS


def _kernel_path(layer: Any, states: Sequence[torch.Tensor]) -> Any:
    """The decode step these kernels run for ``layer``, or None (the reference serves it)."""
    if _is_mamba2(layer, states):
        return _mamba2_decode
    if len(states) == 1 and all(hasattr(layer, a) for a in _SHORT_CONV) and hasattr(layer.conv, "weight"):
        return _short_conv_decode
    return None


class TritonMixerBackend(MixerBackend):
    """Mamba2 (transformers' Bamba, GraniteMoeHybrid, FalconH1 and NemotronH mixers) and LFM2's
    short convolution: each decode step is the module's projections around two Triton kernels
    that update every row's conv window and SSM state in place at its slot. No host sync, so a
    decode step can be captured in a CUDA graph. Mamba2 prefill runs the chunked scan as batched
    matrix products; other prefill runs the torch reference."""

    name: ClassVar[str] = "triton-mixer"
    mamba_types: ClassVar[tuple[str, ...]] = ("mamba2", "short_conv")

    @staticmethod
    def decode(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
               slot_ids: torch.Tensor) -> torch.Tensor:
        step = _kernel_path(layer, states)
        if step is None:
            return TorchMixerBackend.decode(layer, hidden_states, states, slot_ids)
        return step(layer, hidden_states, states, slot_ids)

    @staticmethod
    def prefill(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor], slot_id: int) -> torch.Tensor:
        if not _is_mamba2(layer, states):
            return TorchMixerBackend.prefill(layer, hidden_states, states, slot_id)
        return mamba2_prefill(layer, hidden_states[None], states, slice(slot_id, slot_id + 1))[0]

    @staticmethod
    def prefill_batch(layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                      slot_ids: Sequence[int]) -> torch.Tensor:
        if not _is_mamba2(layer, states):
            return TorchMixerBackend.prefill_batch(layer, hidden_states, states, slot_ids)
        rows = torch.tensor(list(slot_ids), dtype=torch.long).to(states[0].device, non_blocking=True)
        return mamba2_prefill(layer, hidden_states, states, rows)

    @classmethod
    def prefill_varlen(cls, layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                       slot_ids: Sequence[int], lengths: Sequence[int],
                       checkpoints: Sequence[Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
        # NOTE: a row's padding scans with dt = 0 (no decay, no input): its state stays as at its end
        if not _is_mamba2(layer, states):
            return super().prefill_varlen(layer, hidden_states, states, slot_ids, lengths, checkpoints)
        rows = torch.tensor(list(slot_ids), dtype=torch.long).to(states[0].device, non_blocking=True)
        return mamba2_prefill(layer, hidden_states, states, rows, checkpoints or (), lengths=lengths)

    @classmethod
    def prefill_checkpoints(cls, layer: Any, hidden_states: torch.Tensor, states: Sequence[torch.Tensor],
                            slot_ids: Sequence[int], checkpoints: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
        # NOTE: the scan's states part-way into a chunk come from the same call, not one call per piece
        if not _is_mamba2(layer, states):
            return TorchMixerBackend.prefill_checkpoints(layer, hidden_states, states, slot_ids, checkpoints)
        rows = torch.tensor(list(slot_ids), dtype=torch.long).to(states[0].device, non_blocking=True)
        return mamba2_prefill(layer, hidden_states, states, rows, checkpoints)
