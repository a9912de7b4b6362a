"""Mixer decode kernels over state slots: the causal-convolution update and Mamba2's selective
state update, each one launch for a whole decode batch, reading and writing the states in place
at each row's slot (rows whose slot is out of range store nothing)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_triton._checks import check_device, value_checks

#: Element types the kernels take for activations and weights; states may also be float32.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Conv activations the update applies (None: none).
ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, weight_ptr, bias_ptr, slot_ptr, out_ptr, num_slots, dim,
    sx_t, sx_d, ss_b, ss_d, ss_k, sw_d, sw_k, so_t, so_d,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d_ok = d < dim
    k = tl.arange(0, K_PAD)[None, :]
    window = state_ptr + slot * ss_b + d[:, None] * ss_d
    # NOTE: a slot out of range stores nothing (no out-of-bounds access); its output is zero.
    # The slot is broadcast to a vector first: the interpreter refuses scalar masks combined.
    slots = d * 0 + slot
    live = (d_ok & (slots >= 0) & (slots < num_slots))[:, None]
    shifted = tl.load(window + (k + 1) * ss_k, mask=live & (k + 1 < K), other=0.0)
    x = tl.load(x_ptr + t * sx_t + d * sx_d, mask=d_ok, other=0.0)
    new = tl.where(k == K - 1, x[:, None].to(shifted.dtype), shifted)
    tl.store(window + k * ss_k, new, mask=live & (k < K))
    w = tl.load(weight_ptr + d[:, None] * sw_d + k * sw_k, mask=d_ok[:, None] & (k < K), other=0.0)
    acc = tl.sum(tl.where(live, new.to(tl.float32), 0.0) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t * so_t + d * so_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check_common(name: str, x: torch.Tensor, slot_ids: torch.Tensor, states: list[torch.Tensor]) -> None:
    check_device(x)
    for tensor in (slot_ids, *states):
        if tensor.device != x.device:
            raise ValueError(f"{name}: every tensor must live on {x.device}, got one on {tensor.device}")
    if slot_ids.dim() != 1 or slot_ids.dtype not in (torch.int32, torch.int64) or slot_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name}: slot_ids must be a 1-D int32/int64 tensor of {x.shape[0]} slots (one per row), got "
            f"{slot_ids.dtype} {tuple(slot_ids.shape)}"
        )
    if x.dtype not in _DTYPES or any(s.dtype not in _DTYPES for s in states):
        raise ValueError(f"{name}: inputs and states must be float16, bfloat16 or float32")


def _check_slots(name: str, slot_ids: torch.Tensor, num_slots: int, validate: bool | None) -> None:
    if value_checks(validate, slot_ids.device) and slot_ids.numel():
        low, high = int(slot_ids.min()), int(slot_ids.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"{name}: slot ids must be in [0, {num_slots}), got {low if low < 0 else high}")


def causal_conv1d_update(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    slot_ids: torch.Tensor, *, activation: str | None = None, out: torch.Tensor | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Append each row of ``x`` ``[T, dim]`` to its slot's convolution window in ``conv_state``
    ``[slots, dim, K]`` (in place; the oldest column drops out) and return the depthwise
    convolution of the new window with ``weight`` ``[dim, K]`` (+ ``bias``), activated.

    ``validate``: check on the host that every slot is in range (a device sync; None: on CPU
    tensors or under ``KVCORE_DEBUG_CHECKS=1``); unchecked, out-of-range rows store nothing.
    """
    _check_common("causal_conv1d_update", x, slot_ids, [conv_state, weight])
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_update: activation {activation!r} is not one of {list(ACTIVATIONS)}")
    if x.dim() != 2 or conv_state.dim() != 3 or weight.dim() != 2:
        raise ValueError(
            f"causal_conv1d_update: x must be [T, dim], conv_state [slots, dim, K] and weight [dim, K]; got "
            f"{tuple(x.shape)}, {tuple(conv_state.shape)}, {tuple(weight.shape)}"
        )
    num_slots, dim, kernel = conv_state.shape
    if x.shape[1] != dim or tuple(weight.shape) != (dim, kernel) or (bias is not None and tuple(bias.shape) != (dim,)):
        raise ValueError(
            f"causal_conv1d_update: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
            f"{None if bias is None else tuple(bias.shape)} do not fit conv_state {tuple(conv_state.shape)}"
        )
    _check_slots("causal_conv1d_update", slot_ids, num_slots, validate)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if out.shape != x.shape:
        raise ValueError(f"causal_conv1d_update: out must be {tuple(x.shape)}, got {tuple(out.shape)}")
    if x.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(dim), 128)
    _conv_update_kernel[(x.shape[0], triton.cdiv(dim, block))](
        x, conv_state, weight, bias if bias is not None else weight, slot_ids, out, num_slots, dim,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        K=kernel, K_PAD=triton.next_power_of_2(kernel), BLOCK_D=block, HAS_BIAS=bias is not None,
        SILU=activation is not None,
    )
    return out


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, z_ptr, slot_ptr, out_ptr,
    num_slots, head_dim, heads_per_group,
    ss_b, ss_h, ss_p, ss_n, sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    sz_t, sz_h, sz_p, so_t, so_h, so_p,
    N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_P: tl.constexpr, HAS_Z: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_PAD)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    g = h // heads_per_group
    slots = p * 0 + slot
    p_ok = p < head_dim
    live = (p_ok & (slots >= 0) & (slots < num_slots))[:, None]
    # NOTE: as transformers' decode step: softplus(dt + bias) (threshold 20), exp(dt * A), A = -exp(A_log).
    dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    decay = tl.exp(dt * -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)))
    b = tl.load(b_ptr + t * sb_t + g * sb_g + n * sb_n, mask=n < N, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t * sc_t + g * sc_g + n * sc_n, mask=n < N, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * sx_t + h * sx_h + p * sx_p, mask=p_ok, other=0.0).to(tl.float32)
    tile = state_ptr + slot * ss_b + h * ss_h + p[:, None] * ss_p + n[None, :] * ss_n
    mask = live & (n[None, :] < N)
    state = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    state = state * decay + (dt * b)[None, :] * x[:, None]
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=mask)
    y = tl.sum(tl.where(mask, state, 0.0) * c[None, :], axis=1) + x * tl.load(d_ptr + h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + t * sz_t + h * sz_h + p * sz_p, mask=p_ok, other=0.0).to(tl.float32)
        y = y * z * tl.sigmoid(z)
    tl.store(out_ptr + t * so_t + h * so_h + p * so_p, y.to(out_ptr.dtype.element_ty), mask=p_ok)


def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
    c: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor, slot_ids: torch.Tensor, *,
    z: torch.Tensor | None = None, out: torch.Tensor | None = None, validate: bool | None = None,
) -> torch.Tensor:
    """Mamba2's recurrent step for each row, on its slot of ``state`` ``[slots, H, P, N]`` (in
    place): ``dt = softplus(dt + dt_bias)``, ``state = state * exp(-dt * exp(a_log)) + dt * b * x``,
    ``y = state @ c + d * x`` (times ``silu(z)`` with ``z``).

    ``x``, ``z``: ``[T, H, P]``; ``dt``: ``[T, H]``; ``b``, ``c``: ``[T, G, N]`` (G groups of
    heads); ``a_log``, ``d``, ``dt_bias``: ``[H]``. Returns ``y`` ``[T, H, P]``; ``validate`` as
    for :func:`causal_conv1d_update`.
    """
    _check_common("selective_state_update", x, slot_ids, [state, dt, b, c])
    if state.dim() != 4 or x.dim() != 3 or dt.dim() != 2 or b.dim() != 3 or c.shape != b.shape:
        raise ValueError(
            "selective_state_update: state must be [slots, H, P, N], x [T, H, P], dt [T, H], b and c "
            f"[T, G, N]; got {tuple(state.shape)}, {tuple(x.shape)}, {tuple(dt.shape)}, {tuple(b.shape)}, "
            f"{tuple(c.shape)}"
        )
    num_slots, heads, head_dim, size = state.shape
    rows, groups = x.shape[0], b.shape[1]
    fits = (
        tuple(x.shape) == (rows, heads, head_dim) and tuple(dt.shape) == (rows, heads)
        and tuple(b.shape) == (rows, groups, size) and groups > 0 and heads % groups == 0
        and all(tuple(v.shape) == (heads,) for v in (a_log, d, dt_bias))
        and (z is None or z.shape == x.shape)
    )
    if not fits:
        raise ValueError(
            f"selective_state_update: x {tuple(x.shape)}, dt {tuple(dt.shape)}, b {tuple(b.shape)}, "
            f"a_log/d/dt_bias {[tuple(v.shape) for v in (a_log, d, dt_bias)]} and z "
            f"{None if z is None else tuple(z.shape)} do not fit state {tuple(state.shape)} (heads a "
            "multiple of groups)"
        )
    _check_slots("selective_state_update", slot_ids, num_slots, validate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape:
        raise ValueError(f"selective_state_update: out must be {tuple(x.shape)}, got {tuple(out.shape)}")
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(head_dim), 16)
    _state_update_kernel[(rows, heads, triton.cdiv(head_dim, block))](
        state, x, dt, a_log, b, c, d, dt_bias, x if z is None else z, slot_ids, out,
        num_slots, head_dim, heads // groups,
        *state.stride(), *x.stride(), *dt.stride(), *b.stride(), *c.stride(),
        *(x if z is None else z).stride(), *out.stride(),
        N=size, N_PAD=triton.next_power_of_2(size), BLOCK_P=block, HAS_Z=z is not None,
    )
    return out
