"""kvcore-triton's Mamba2 prefill: the chunked scan equals the token-by-token recurrence it
computes, and whole prefill calls equal transformers' own modules (the torch reference) for every
Mamba2 hybrid, continuing from and writing back only the listed slots."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcore.testing import DEVICE
from kvcore_triton._checks import INTERPRETED
from kvcore_triton.mamba2_prefill import causal_conv, chunk_scan, step_sizes
from kvcore_triton.scan_kernels import decayed_scores, runs_on, scan_dt

transformers = pytest.importorskip("transformers")

from kvcore.hf import specs_from_config  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore_torch.mixers import TorchMixerBackend  # noqa: E402
from kvcore_triton.mixers import TritonMixerBackend  # noqa: E402

MAMBA2_ARCHS = ["bamba", "granitemoehybrid", "falcon_h1", "nemotron_h"]


def recurrence(x, dt, a, b, c, d, initial):
    """Mamba2 one token at a time: h = exp(dt a) h + dt b x, y = h . c + d x (float64)."""
    x, dt, a, b, c, d, h = (t.double() for t in (x, dt, a, b, c, d, initial))
    per = x.shape[2] // b.shape[2]
    b, c = b.repeat_interleave(per, dim=2), c.repeat_interleave(per, dim=2)
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * a)[:, :, None, None]
        h = h * decay + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * b[:, t, :, None, :]
        ys.append((h * c[:, t, :, None, :]).sum(-1) + d[None, :, None] * x[:, t])
    return torch.stack(ys, 1), h


def scan_inputs(seed, rows, length, groups, per, *, p, n):
    """Random scan inputs: ``x``, ``dt`` (after softplus), ``a`` (negative), ``b``, ``c``, ``d``, ``initial``."""
    gen = torch.Generator().manual_seed(seed)
    heads = groups * per
    x = torch.randn(rows, length, heads, p, generator=gen)
    dt = F.softplus(torch.randn(rows, length, heads, generator=gen))
    a = -torch.rand(heads, generator=gen) * 2
    b, c = (torch.randn(rows, length, groups, n, generator=gen) for _ in range(2))
    d, initial = torch.randn(heads, generator=gen), torch.randn(rows, heads, p, n, generator=gen)
    return x, dt, a, b, c, d, initial


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 40), chunk=st.sampled_from([4, 8, 16]),
       groups=st.integers(1, 2), per=st.integers(1, 3), kernel=st.booleans(), seed=st.integers(0, 2**16))
def test_the_chunked_scan_is_the_recurrence(rows, length, chunk, groups, per, kernel, seed):
    # NOTE: both ways of weighting a chunk's tokens: the Triton kernel (where it runs) and the PyTorch ops
    assume(not kernel or runs_on(torch.device(DEVICE)))
    x, dt, a, b, c, d, initial = scan_inputs(seed, rows, length, groups, per, p=5, n=6)
    with mock.patch("kvcore_triton.mamba2_prefill.runs_on", return_value=kernel):
        y, final = chunk_scan(*(t.to(DEVICE) for t in (x, dt, a, b, c, d, initial)), chunk)
    want_y, want_final = recurrence(x, dt, a, b, c, d, initial)
    torch.testing.assert_close(y.cpu().double(), want_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final.cpu().double(), want_final, rtol=1e-4, atol=1e-4)


def test_a_16_bit_convolution_with_a_float32_bias_keeps_the_float32_sum():
    # NOTE: a model that keeps some parameters in float32: no dtype clash, the shifted products instead
    gen = torch.Generator().manual_seed(4)
    window, x = torch.randn(2, 6, 4, generator=gen), torch.randn(2, 5, 6, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    half = [t.bfloat16().to(DEVICE) for t in (window, x, weight)]
    out, inputs = causal_conv(half[0], half[1], half[2], bias.to(DEVICE), "silu")
    want, _ = causal_conv(*(t.float() for t in half), bias.to(DEVICE), "silu")
    assert out.dtype == torch.bfloat16 and inputs.shape == (2, 6, 9)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_scan_multiplies_in_its_dtype_within_its_rounding(dtype):
    # NOTE: a 16-bit model's largest product runs in its dtype (sums in float32): its error is the
    # dtype's rounding, while the states passed between chunks stay float32-exact
    x, dt, a, b, c, d, initial = scan_inputs(7, 2, 50, 2, 2, p=8, n=6)
    x = x.to(dtype)
    y, final = chunk_scan(*(t.to(DEVICE) for t in (x, dt, a, b, c, d, initial)), 16)
    want_y, want_final = recurrence(x.float(), dt, a, b, c, d, initial)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    error = (y.cpu().double() - want_y).norm() / want_y.norm()
    assert 1e-6 < error < 2e-2  # NOTE: not float32-exact: the products did run in 16 bits
    torch.testing.assert_close(final.cpu().double(), want_final, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size, groups, per", [(256, 1, 3), (37, 2, 2), (1, 1, 1)])
def test_decayed_scores_keep_short_decays_exact_deep_into_a_long_chunk(size, groups, per):
    # NOTE: a dt summing to about -1,000 over the chunk: a difference of two prefix sums would
    # leave a relative error of ~1e-4 on the near-diagonal weights; summed per row it is ~1e-7
    if not runs_on(torch.device(DEVICE)):
        pytest.skip("Triton kernels do not run here (no CUDA, no interpreter)")
    gen = torch.Generator().manual_seed(size)
    chunks, heads = 2, groups * per
    scores = torch.randn(chunks, groups, size, size, generator=gen)
    adt = -torch.rand(chunks, heads, size, generator=gen) * 8
    got = decayed_scores(scores.to(DEVICE), adt.to(DEVICE)).cpu().double()
    sums = adt.double().cumsum(-1)
    segment = (sums[..., :, None] - sums[..., None, :])  # float64: exact enough as a reference
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    want = torch.where(causal, scores.double().repeat_interleave(per, dim=1) * segment.exp(), 0.0)
    assert got.shape == (chunks, heads, size, size) and not got[..., ~causal].any()
    # float32 rounding of a sum grows with its size: allow ~8 ulps of the exponent
    bound = want.abs() * 1e-6 * (1 + segment.abs().masked_fill(~causal, 0)) + 1e-30
    assert ((got - want).abs() <= bound).all()


def test_decayed_scores_refuse_mismatched_shapes_by_name():
    if not runs_on(torch.device(DEVICE)):
        pytest.skip("Triton kernels do not run here (no CUDA, no interpreter)")
    with pytest.raises(ValueError, match="multiple of G"):
        decayed_scores(torch.zeros(1, 2, 4, 4, device=DEVICE), torch.zeros(1, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        decayed_scores(torch.zeros(1, 1, 4, 4, device=DEVICE).half(), torch.zeros(1, 1, 4, device=DEVICE))


@pytest.mark.skipif(not runs_on(torch.device(DEVICE)), reason="kvcore-triton's kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("limit, lengths, tokens", [(None, None, 7), ((0.01, 5.0), None, 7), ((0.01, 5.0), None, 1),
                                                    ((0.01, 5.0), [1, 7, 3], 7), (None, [7, 2, 1], 7)])
def test_the_step_size_kernel_is_the_pytorch_ops(dtype, limit, lengths, tokens):
    # NOTE: dt a split of a wider projection; values from deep in softplus's tail (log1p) to past its threshold
    gen = torch.Generator().manual_seed(3)
    projected = (torch.randn(3, tokens, 40, generator=gen) * 12).to(device=DEVICE, dtype=dtype)
    dt, bias = projected[..., 9:21], torch.randn(12, generator=gen).to(device=DEVICE, dtype=dtype)
    lengths = None if lengths is None else torch.tensor(lengths, device=DEVICE)
    got = scan_dt(dt, bias, limit, lengths)
    with mock.patch("kvcore_triton.mamba2_prefill.runs_on", return_value=False):
        want = step_sizes(dt, bias, limit, lengths).float()  # NOTE: the PyTorch ops
    assert got.dtype == torch.float32 and got.shape == want.shape
    # NOTE: float32 within 4e-6 (a GPU's exp is approximate: its error grows with |dt|, to about 1e-6
    # at 20); 16-bit values one rounding step apart. The interpreter truncates where a GPU rounds to
    # nearest: a 16-bit dt + bias one step lower, deep in softplus's tail (~exp), moves the result by
    # up to |dt| times that step (0.125 at -18 in bfloat16: 13%)
    step = 4e-6 if dtype == torch.float32 else (0.2 if INTERPRETED else 2 * torch.finfo(dtype).eps)
    assert ((got - want).abs() <= step * want.abs()).all()
    if lengths is not None:
        past = torch.arange(tokens, device=DEVICE) >= lengths[:, None]
        assert not got[past].any() and torch.equal(got[~past] > 0, want[~past] > 0)


@pytest.fixture(scope="module")
def mixers():
    found = {}
    for arch in MAMBA2_ARCHS:
        for dtype in (torch.float32, torch.bfloat16):
            model = random_model(model_config(arch), seed=3, dtype=dtype, device=DEVICE)
            name, spec = next((n, s) for n, s in specs_from_config(model.config, dtype=dtype).items()
                              if getattr(s, "mamba_type", None) == "mamba2")
            found[arch, dtype] = model.get_submodule(name), spec
    return found


def assert_states(got, want, before, tol, untouched, written):
    """Each state within ``tol`` of the reference's; slots ``untouched`` as they were, ``written`` not."""
    for mine, theirs, old in zip(got, want, before):
        assert (mine.float() - theirs.float()).abs().max() <= tol * theirs.float().abs().max()
        assert torch.equal(mine[untouched], old[untouched]) and not torch.equal(mine[written], old[written])


@pytest.mark.parametrize("arch", MAMBA2_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, length", [(1, 5), (3, 16), (2, 37), (2, 2), (4, 1)])
def test_prefill_equals_transformers_modules_on_the_listed_slots(mixers, arch, dtype, rows, length, monkeypatch):
    # NOTE: the reference's cuDNN convolution would round through TF32 on a GPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, spec = mixers[arch, dtype]
    gen = torch.Generator().manual_seed(rows * 100 + length)
    slots = [5, 2, 3, 1][:rows]
    states = [torch.randn(7, *shape, generator=gen).to(dtype=dt, device=DEVICE) for shape, dt in
              zip(spec.shapes, spec.dtypes)]
    x = torch.randn(rows, length, module.hidden_size, generator=gen).to(dtype=dtype, device=DEVICE)
    got, want = [s.clone() for s in states], [s.clone() for s in states]
    with torch.inference_mode():
        if rows == 1:
            out = TritonMixerBackend.prefill(module, x[0], got, slots[0])[None]
            ref = TorchMixerBackend.prefill(module, x[0], want, slots[0])[None]
        else:
            out = TritonMixerBackend.prefill_batch(module, x, got, slots)
            ref = TorchMixerBackend.prefill_batch(module, x, want, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max() <= tol * scale
    assert_states(got, want, states, tol, [s for s in range(7) if s not in slots], slots)


@pytest.mark.parametrize("arch", MAMBA2_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[5, 16, 2], [37, 20], [1, 9, 9, 4]])
def test_chunks_of_different_lengths_in_one_call_equal_each_chunk_alone(mixers, arch, dtype, lengths, monkeypatch):
    # NOTE: padding positions hold random tokens: they must change neither the rows' outputs nor their states
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, spec = mixers[arch, dtype]
    gen = torch.Generator().manual_seed(sum(lengths))
    slots = [4, 1, 6, 2][: len(lengths)]
    states = [torch.randn(7, *shape, generator=gen).to(dtype=dt, device=DEVICE) for shape, dt in
              zip(spec.shapes, spec.dtypes)]
    x = torch.randn(len(lengths), max(lengths), module.hidden_size, generator=gen).to(dtype=dtype, device=DEVICE)
    got, want = [s.clone() for s in states], [s.clone() for s in states]
    with torch.inference_mode():
        out = TritonMixerBackend.prefill_varlen(module, x, got, slots, lengths)
        refs = [TorchMixerBackend.prefill(module, row[:n], want, slot) for row, n, slot in zip(x, lengths, slots)]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.shape == x.shape
    for row, ref, n in zip(out, refs, lengths):
        assert (row[:n].float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    assert_states(got, want, states, tol, [s for s in range(7) if s not in slots], slots)


@pytest.mark.parametrize("arch", MAMBA2_ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths, cuts", [
    ([37, 20], [[16, 32, 37], [20]]),  # NOTE: on scan-chunk boundaries, and at each row's end
    ([40, 9, 33], [[16, 32], [], [3, 33]]),  # NOTE: part-way into a chunk; a row without any
    ([30, 12], [[8, 24], [5, 12]]),
])
def test_chunks_of_different_lengths_keep_their_checkpoints_in_one_call(mixers, arch, dtype, lengths, cuts,
                                                                      monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, spec = mixers[arch, dtype]
    gen = torch.Generator().manual_seed(sum(lengths) + 7)
    slots = [4, 1, 6][: len(lengths)]
    free = iter(range(8, 16))
    checkpoints = [[(t, next(free)) for t in row] for row in cuts]
    states = [torch.randn(16, *shape, generator=gen).to(dtype=dt, device=DEVICE) for shape, dt in
              zip(spec.shapes, spec.dtypes)]
    x = torch.randn(len(lengths), max(lengths), module.hidden_size, generator=gen).to(dtype=dtype, device=DEVICE)
    got, want = [s.clone() for s in states], [s.clone() for s in states]
    with torch.inference_mode():
        out = TritonMixerBackend.prefill_varlen(module, x, got, slots, lengths, checkpoints)
        refs = [TorchMixerBackend.prefill_checkpoints(module, row[None, :n], want, [slot], [kept])[0]
                for row, n, slot, kept in zip(x, lengths, slots, checkpoints)]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for row, ref, n in zip(out, refs, lengths):
        assert (row[:n].float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    kept = [slot for row in checkpoints for _, slot in row]
    untouched = [s for s in range(16) if s not in slots + kept]
    assert_states(got, want, states, tol, untouched, kept)


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_4096_token_scan_at_a_granite_4_h_shape_needs_little_memory():
    # NOTE: 64 heads of 64 x 128 in 256-token chunks: transformers' reference multiplies out 2 GiB per chunk
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4096, 64, 64, device="cuda", generator=gen)
    dt = F.softplus(torch.randn(1, 4096, 64, device="cuda", generator=gen))
    b, c = (torch.randn(1, 4096, 1, 128, device="cuda", generator=gen) for _ in range(2))
    a, d = -torch.rand(64, device="cuda", generator=gen), torch.randn(64, device="cuda", generator=gen)
    initial = torch.zeros(1, 64, 64, 128, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y, _ = chunk_scan(x, dt, a, b, c, d, initial, 256)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 3 << 30 and torch.isfinite(y).all()


def recurrence_states(x, dt, a, b, c, d, initial):
    """The recurrence's states after every token: ``[k, T, H, P, N]`` (float64)."""
    found = []
    for t in range(1, x.shape[1] + 1):
        found.append(recurrence(x[:, :t], dt[:, :t], a, b[:, :t], c[:, :t], d, initial)[1])
    return torch.stack(found, 1)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 3), length=st.integers(1, 30), chunk=st.sampled_from([4, 8, 16]),
       groups=st.integers(1, 2), per=st.integers(1, 2), picks=st.integers(1, 6), aligned=st.booleans(),
       seed=st.integers(0, 2**16))
def test_states_part_way_into_the_scan_are_the_recurrences(rows, length, chunk, groups, per, picks, aligned, seed):
    x, dt, a, b, c, d, initial = scan_inputs(seed, rows, length, groups, per, p=3, n=4)
    gen = torch.Generator().manual_seed(seed + 1)
    which = torch.randint(0, rows, (picks,), generator=gen)
    tokens = torch.randint(1, length + 1, (picks,), generator=gen)
    if aligned:  # NOTE: on chunk boundaries, or the end
        tokens = torch.where(tokens == length, tokens, (tokens // chunk).clamp(min=1) * chunk).clamp(max=length)
    y, found = chunk_scan(*(t.to(DEVICE) for t in (x, dt, a, b, c, d, initial)), chunk,
                          at=list(zip(which.tolist(), tokens.tolist())))
    want = recurrence_states(x, dt, a, b, c, d, initial)[which, tokens - 1]
    assert found.shape == (picks, groups * per, 3, 4)
    torch.testing.assert_close(found.cpu().double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.cpu().double(), recurrence(x, dt, a, b, c, d, initial)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MAMBA2_ARCHS)
@pytest.mark.parametrize("rows, length, cuts", [
    (1, 16, [[4, 16]]), (2, 37, [[8, 24], [30]]), (3, 9, [[], [2], [9]]),
    (1, 48, [[16, 32, 48]]), (2, 40, [[16, 32], [32, 40]]),  # NOTE: on the module's 16-token chunks
])
def test_checkpoints_from_one_scan_equal_the_pieces_of_the_reference(mixers, arch, rows, length, cuts, monkeypatch):
    # NOTE: the reference runs the chunk in pieces ending at each checkpoint and copies the states
    # (none of one token: transformers' one-token step leaves dt unclamped, a whole prefill does not)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, spec = mixers[arch, torch.float32]
    gen = torch.Generator().manual_seed(rows * 100 + length)
    slots = [5, 2, 3][:rows]
    free = iter([9, 10, 11, 12, 13, 8])
    checkpoints = [[(t, next(free)) for t in row] for row in cuts]
    states = [torch.randn(14, *shape, generator=gen).to(dtype=dt, device=DEVICE) for shape, dt in
              zip(spec.shapes, spec.dtypes)]
    x = torch.randn(rows, length, module.hidden_size, generator=gen).to(device=DEVICE)
    got, want = [s.clone() for s in states], [s.clone() for s in states]
    with torch.inference_mode():
        out = TritonMixerBackend.prefill_checkpoints(module, x, got, slots, checkpoints)
        ref = TorchMixerBackend.prefill_checkpoints(module, x, want, slots, checkpoints)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    kept = [slot for row in checkpoints for _, slot in row]
    untouched = [s for s in range(14) if s not in slots + kept]
    for mine, theirs, before in zip(got, want, states):
        assert (mine - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        assert torch.equal(mine[untouched], before[untouched]) and not torch.equal(mine[kept], before[kept])
