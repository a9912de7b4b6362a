"""The slot-indexed mixer decode kernels match plain-torch references on random data (CPU: the
Triton interpreter), update exactly the listed slots of strided state views, and refuse bad input
on the host before launching."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.testing import DEVICE
from kvcore_triton.mixer_kernels import causal_conv1d_update, selective_state_update


def strided_states(gen, slots, shape, dtype, *, spare=24):
    """``[slots, *shape]`` states inside a larger random buffer (other layers' bytes between
    blocks, as a block-outermost layout keeps them); returns the view and the whole buffer."""
    numel = torch.Size(shape).numel()
    buf = torch.randn(slots * (numel + spare) + 7, generator=gen).to(dtype)
    view = buf[7:].as_strided((slots, *shape), (numel + spare, *torch.empty(shape).stride()))
    return view, buf


def conv_reference(x, state, weight, bias, slots, silu):
    new = torch.cat([state[slots.long()], x[:, :, None].to(state.dtype)], -1)[:, :, 1:]
    out = (new.float() * weight.float()).sum(-1) + (0 if bias is None else bias.float())
    return (F.silu(out) if silu else out).to(x.dtype), new


def ssm_reference(state, x, dt, a_log, b, c, d, dt_bias, slots, z):
    heads, groups = x.shape[1], b.shape[1]
    dt = F.softplus(dt.float() + dt_bias.float())[:, :, None, None]
    decay = torch.exp(dt * -torch.exp(a_log.float())[None, :, None, None])
    b = b.float().repeat_interleave(heads // groups, dim=1)[:, :, None, :]
    c = c.float().repeat_interleave(heads // groups, dim=1)
    new = state[slots.long()].float() * decay + dt * b * x.float()[..., None]
    y = (new * c[:, :, None, :]).sum(-1) + x.float() * d.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), new.to(state.dtype)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 5), dim=st.integers(1, 150), kernel=st.integers(2, 5), bias=st.booleans(),
       silu=st.booleans(), seed=st.integers(0, 2**16))
def test_conv_update_matches_the_reference_and_touches_only_listed_slots(rows, dim, kernel, bias, silu, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = rows + 3
    state, buf = strided_states(gen, num_slots, (dim, kernel), torch.float32)
    before, buf_before = state.clone(), buf.clone()
    slots = torch.randperm(num_slots, generator=gen)[:rows].to(torch.int32)
    x = torch.randn(rows, 2 * dim, generator=gen)[:, ::2]  # NOTE: a strided slice, as after a split
    weight, b = torch.randn(dim, kernel, generator=gen), torch.randn(dim, generator=gen) if bias else None
    want, new = conv_reference(x, before, weight, b, slots, silu)
    dev_buf = buf.to(DEVICE)
    dev_state = dev_buf[7:].as_strided(state.shape, state.stride())
    out = torch.full((rows, dim), float("nan"), device=DEVICE)
    causal_conv1d_update(x.to(DEVICE), dev_state, weight.to(DEVICE), None if b is None else b.to(DEVICE),
                         slots.to(DEVICE), activation="silu" if silu else None, out=out)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    expected = before.clone()
    expected[slots.long()] = new
    assert torch.equal(dev_state.cpu(), expected)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[7:].as_strided(state.shape, state.stride()).fill_(False)
    assert torch.equal(dev_buf.cpu()[outside], buf_before[outside])  # NOTE: other layers' bytes untouched


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 4), heads_per_group=st.integers(1, 3), groups=st.integers(1, 2),
       head_dim=st.integers(1, 20), size=st.sampled_from([3, 8, 16]), gate=st.booleans(),
       seed=st.integers(0, 2**16))
def test_state_update_matches_the_reference(rows, heads_per_group, groups, head_dim, size, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, num_slots = heads_per_group * groups, rows + 2
    state, _ = strided_states(gen, num_slots, (heads, head_dim, size), torch.float32)
    before = state.clone()
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    x = torch.randn(rows, heads, head_dim, generator=gen)
    dt = torch.randn(rows, heads, generator=gen) * 3  # NOTE: both sides of softplus' threshold with the bias
    dt_bias = torch.randn(heads, generator=gen) * 10
    a_log, d = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    b, c = torch.randn(rows, groups, size, generator=gen), torch.randn(rows, groups, size, generator=gen)
    z = torch.randn(rows, heads, head_dim, generator=gen) if gate else None
    want, new = ssm_reference(before, x, dt, a_log, b, c, d, dt_bias, slots, z)
    on = [t.to(DEVICE) if t is not None else None for t in (x, dt, a_log, b, c, d, dt_bias, slots, z)]
    state = state.to(DEVICE)
    out = selective_state_update(state, *on[:8], z=on[8]).cpu()
    state = state.cpu()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    expected = before.clone()
    expected[slots] = new
    torch.testing.assert_close(state, expected, rtol=1e-6, atol=1e-6)
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_bfloat16_activations_over_float32_states():
    gen = torch.Generator().manual_seed(3)
    state = torch.randn(4, 2, 8, 16, generator=gen)
    x = torch.randn(2, 2, 8, generator=gen).bfloat16()
    dt, b, c = torch.randn(2, 2, generator=gen).bfloat16(), *torch.randn(2, 2, 1, 16, generator=gen).bfloat16()
    params = [torch.randn(2, generator=gen) for _ in range(3)]
    slots = torch.tensor([2, 0])
    want, new = ssm_reference(state.clone(), x, dt, params[0], b, c, params[1], params[2], slots, None)
    state = state.to(DEVICE)
    out = selective_state_update(state, *(t.to(DEVICE) for t in (x, dt, params[0], b, c, params[1], params[2], slots)))
    out, state = out.cpu(), state.cpu()
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state[slots], new, rtol=1e-2, atol=1e-2)


def test_out_of_range_slots_store_nothing_when_unchecked():
    gen = torch.Generator().manual_seed(1)
    state = torch.randn(3, 6, 4, generator=gen).to(DEVICE)
    before = state.clone()
    x, weight = torch.randn(2, 6, generator=gen).to(DEVICE), torch.randn(6, 4, generator=gen).to(DEVICE)
    out = causal_conv1d_update(x, state, weight, None, torch.tensor([5, -1], device=DEVICE), validate=False)
    assert torch.equal(state, before) and torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match=r"slot ids must be in \[0, 3\), got 5"):
        causal_conv1d_update(x, state, weight, None, torch.tensor([5, 1], device=DEVICE), validate=True)
    assert torch.equal(state, before)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"slots": torch.tensor([0.0, 1.0])}, "slot_ids must be a 1-D int32/int64 tensor of 2 slots"),
        ({"slots": torch.tensor([0, 1, 2])}, "slot_ids must be a 1-D int32/int64 tensor of 2 slots"),
        ({"weight": torch.ones(5, 4)}, r"do not fit conv_state \(3, 6, 4\)"),
        ({"x": torch.ones(2, 6, dtype=torch.int32)}, "must be float16, bfloat16 or float32"),
        ({"activation": "gelu"}, r"activation 'gelu' is not one of \[None, 'silu', 'swish'\]"),
    ],
)
def test_conv_update_refuses_bad_input_before_launching(change, message):
    state = torch.zeros(3, 6, 4, device=DEVICE)
    args = {"x": torch.ones(2, 6), "weight": torch.ones(6, 4), "slots": torch.tensor([0, 1]), "activation": None,
            **change}
    on = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=message):
        causal_conv1d_update(on["x"], state, on["weight"], None, on["slots"], activation=on["activation"])
    assert not state.any()


def test_state_update_refuses_heads_that_are_no_multiple_of_groups():
    state, ones = torch.zeros(2, 3, 4, 8, device=DEVICE), torch.ones(3, device=DEVICE)
    x, dt, bc = torch.ones(1, 3, 4, device=DEVICE), torch.ones(1, 3, device=DEVICE), torch.ones(1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"do not fit state \(2, 3, 4, 8\) \(heads a multiple of groups\)"):
        selective_state_update(state, x, dt, ones, bc, bc, ones, ones, torch.tensor([1], device=DEVICE))
    assert not state.any()
