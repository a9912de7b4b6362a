"""kvcore-triton over quantized caches agrees with the torch reference (CPU: Triton interpreter).

The store kernel quantizes in the same launch as it writes and must store the reference's bytes
exactly (values and scales); the decode (both read paths) and varlen kernels read 8-bit tiles
and scale scores and probabilities, and must equal the reference reading the same cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_paged_cases import DEVICE, make_batch

import kvcore_torch
from kvcore import FullAttentionSpec, allocate_kv_cache, plan_kv_cache
from kvcore.memory.views import allocate_scale_views
from kvcore.plugins.backend import KVQuantState
from kvcore.specs.quant import quantize_specs
from kvcore_triton import KernelConfig, paged_attention, write_kv

MODES = ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
LAYOUTS = ["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
DECODE = ([23, 40], [1, 1])
TILE16 = KernelConfig(tile=16)
MIXED = ([17, 40, 9], [17, 6, 1])


def _cache(mode, layout, *, block_size=16, num_blocks=8, heads=2, head_size=16, kernel=None, k_scale=0.7):
    spec = FullAttentionSpec(block_size, heads, head_size, torch.float32)
    spec = quantize_specs({"a": spec, "b": spec}, mode)["a"]
    config = plan_kv_cache({"a": spec, "b": spec}, layout, num_blocks=num_blocks)
    kernels = None if kernel is None else [kernel]
    views = allocate_kv_cache(config, DEVICE, kernel_block_sizes=kernels)
    raw = torch.empty(0, dtype=torch.int8, device=DEVICE).set_(views["a"].untyped_storage())
    scales = allocate_scale_views(config, raw, kernels).get("a")
    return views["a"], raw, KVQuantState(spec.kv_quant, spec.dtype, k_scale, 1.3, scales)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_store_kernel_writes_the_references_bytes(mode, layout):
    heads, head_size = 3, 24  # NOTE: neither a power of two: padded rows and heads in the kernel
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(30, heads, head_size, generator=gen) * torch.logspace(-2, 2, 30)[:, None, None]
    value = torch.randn(30, heads, head_size, generator=gen)
    key[4] = 0.0
    key[5, 1, 2] = 1e30
    # NOTE: 127 / amax rounded once stores 1 here, 127 * (1 / amax) stores 2 (int8 per token and head).
    key[6, 0, :2] = torch.tensor([2.460373640060425, 0.029059529304504395])
    key[8, 2] *= 1e-37  # NOTE: max / amax overflows float32 (a finite inverse stands in)
    slots = torch.randperm(8 * 16, generator=gen)[:30]
    slots[7] = -1  # padding: skipped
    written = []
    for backend in (kvcore_torch, None):
        view, raw, state = _cache(mode, layout, heads=heads, head_size=head_size)
        raw.fill_(-1)
        (backend.write_kv if backend else write_kv)(view, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE),
                                                     head_size, kv_quant=state)
        written.append(raw.cpu())
    assert torch.equal(written[0], written[1]), int((written[0] != written[1]).sum())
    assert (written[1] != -1).any()


def _both(mode, layout, reqs, *, block_size=16, ratio=1, q_dtype=torch.float32, config=TILE16,
          window=None, poison=False):
    """The reference and the Triton kernels reading one cache the reference wrote (``config`` None:
    the kernels' own default launch)."""
    seq_lens, q_lens = reqs
    kernel = block_size // ratio
    num_blocks = len(seq_lens) * max(-(-n // block_size) for n in seq_lens) + 2
    view, raw, state = _cache(mode, layout, block_size=block_size, num_blocks=num_blocks,
                              kernel=kernel if ratio > 1 else None)
    if poison:  # NOTE: slots never written hold NaN bytes (0xFF) and NaN scales
        raw.fill_(-1)
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=2, q_heads=4, head_size=16, dtype=torch.float32,
                       num_blocks=num_blocks, block_size=block_size, ratio=ratio)
    slots = torch.cat([batch.slots(kernel, False), batch.slots(kernel, True)])
    keys = torch.cat([batch.tokens(batch.keys, False), batch.tokens(batch.keys, True)])
    values = torch.cat([batch.tokens(batch.values, False), batch.tokens(batch.values, True)])
    kvcore_torch.write_kv(view, keys.to(DEVICE), values.to(DEVICE), slots.to(DEVICE), 16, kv_quant=state)
    args = (batch.query.to(DEVICE, q_dtype), view, batch.kernel_table.to(DEVICE), batch.query_start_loc.to(DEVICE),
            batch.seq_lens_tensor.to(DEVICE))
    kwargs = dict(head_size=16, scale=0.25, sliding_window=window, kv_quant=state)
    ref = kvcore_torch.paged_attention(*args, **kwargs) if not poison else None
    out = paged_attention(*args, config=config, **kwargs)
    return out.float().cpu(), None if ref is None else ref.float().cpu()


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("mode", MODES)
def test_decode_matches_the_reference(mode, layout, tma):
    out, ref = _both(mode, layout, DECODE, config=KernelConfig(tile=16, tma=tma))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC"])
@pytest.mark.parametrize("mode", MODES)
def test_prefill_and_mixed_batches_match_the_reference(mode, layout):
    out, ref = _both(mode, layout, MIXED)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["fp8_e4m3", "int8_per_token_head"])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_windows_splits_and_split_kernel_blocks(mode, tma):
    for reqs, window in ((([57, 40, 33], [1, 0, 1]), 21), (MIXED, 9)):
        out, ref = _both(mode, "BLNHC", reqs, window=window, config=KernelConfig(tile=16, num_splits=3, tma=tma))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out, ref = _both(mode, "LBNHC", ([140, 70], [1, 1]), block_size=128, ratio=4,
                     config=KernelConfig(tile=64, tma=tma))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_half_precision_queries_over_an_8bit_cache(mode):
    out, ref = _both(mode, "LBNHC", DECODE, q_dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("mode", ["fp8_e4m3", "fp8_per_token_head"])
def test_nan_bytes_past_the_context_never_reach_the_output(mode, tma):
    for reqs in (([23, 7], [1, 1]), ([21, 9], [21, 2])):
        out, _ = _both(mode, "LBNHC", reqs, config=KernelConfig(tile=16, tma=tma), poison=True)
        assert out.isfinite().all()


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the inline PTX conversions run on CUDA devices only")
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_widened_tiles_decode_as_the_reference(mode, tma):
    """Half-precision queries: K and V widened by inline PTX (V as loaded, or in the operand layout)."""
    outs = []
    for stage_v in (False, True):
        out, ref = _both(mode, "LBNHC", DECODE, q_dtype=torch.bfloat16,
                         config=KernelConfig(tile=16, tma=tma, stage_v=stage_v))
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        outs.append(out)
        poisoned, _ = _both(mode, "LBNHC", ([23, 7], [1, 1]), q_dtype=torch.bfloat16, poison=True,
                            config=KernelConfig(tile=16, tma=tma, stage_v=stage_v))
        assert poisoned.isfinite().all()  # NOTE: NaN bytes past the context, widened by PTX, never reach it
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)


def _lower(kv, quant, name="pointer", tile=64, block_size=16, stage_v=False):
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(script), name, str(tile), str(block_size), "2", "3", "--kv", kv,
                           "--quant", str(quant), *(["--stage-v"] if stage_v else [])],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode and "ptxas" in done.stderr.lower():
        pytest.skip(f"no usable ptxas: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[0])


@pytest.mark.parametrize(("kv", "quant"), [("fp8e4nv", 1), ("fp8e4nv", 2), ("i8", 2)])
@pytest.mark.parametrize(("name", "tile", "block_size"), [("pointer", 64, 16), ("base", 16, 64)])
def test_quantized_decode_lowers_for_sm90_with_8bit_tiles(kv, quant, name, tile, block_size):
    """8-bit K/V tiles stream in (async copies or TMA), widen in registers and meet bf16 MMAs."""
    info = _lower(kv, quant, name, tile, block_size)
    plain = _lower("bf16", 0, name, tile, block_size)
    assert info["mma"] == plain["mma"] > 0
    assert (info["tma_copies"] > 0) == (name == "base") and info["cp_async"] > 0
    if kv.startswith("fp8"):
        assert info["fp8_converts"] > 0  # the hardware fp8 -> f16 conversion, in registers
    assert info["shared"] < plain["shared"]  # half the bytes staged per tile


@pytest.mark.parametrize(("kv", "name", "tile", "block_size"), [("fp8e4nv", "base", 64, 64), ("i8", "pointer", 64, 16)])
def test_staged_v_tiles_load_full_width_and_transpose_as_16_bit(kv, name, tile, block_size):
    """``stage_v``: no 8-bit V operand loaded byte by byte from shared memory; the widened tile
    is transposed by ldmatrix. Either way int8 widens in packed float16 arithmetic, never one
    conversion a value (in the dot's operand layout without ``stage_v``)."""
    plain, staged = (_lower(kv, 2, name, tile, block_size, stage_v=s) for s in (False, True))
    assert plain["ld_shared_b8"] > 0 and staged["ld_shared_b8"] == 0
    assert staged["ldmatrix_trans"] > plain["ldmatrix_trans"] and staged["mma"] == plain["mma"]
    assert staged["int_to_half"] == plain["int_to_half"] == 0
    assert (min(staged["packed_half_subs"], plain["packed_half_subs"]) > 0) == (kv == "i8")


@pytest.mark.parametrize(("kv", "quant"), [("i8", 2), ("fp8e4nv", 2), ("fp8e4nv", 1), ("fp8e5", 1)])
def test_store_kernel_lowers_to_rounded_divisions_and_conversions_for_sm90(kv, quant):
    """On a GPU the store kernel computes the reference's function: divisions rounded to nearest
    (a plain `/` lowers to an approximate one), float8 conversions to nearest even, saturated."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(script), "store", kv, str(quant)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ops = json.loads(done.stdout.splitlines()[0])
    assert not [op for op in ops if op.startswith(("div.", "rcp.")) and op != "div.rn.f32"], ops
    assert ("div.rn.f32" in ops) == (quant == 2)
    if kv != "i8":
        assert ops[f"cvt.rn.satfinite.{'e4m3' if kv == 'fp8e4nv' else 'e5m2'}x2.f32"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_the_default_launch_over_an_8bit_cache_decodes_as_the_reference(mode):
    """No config, as an engine calls it: 64-token tiles over 64-token blocks (TMA where the device
    has it) with the 8-bit default of the storage type; a split's last tile partly masked."""
    half = DEVICE == "cuda"
    reqs = ([300, 130, 64], [1, 1, 1])
    out, ref = _both(mode, "LBNHC", reqs, block_size=64, q_dtype=torch.bfloat16 if half else torch.float32,
                     config=None)
    tol = 3e-2 if half else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    poisoned, _ = _both(mode, "LBNHC", ([300, 70], [1, 1]), block_size=64, config=None, poison=True)
    assert poisoned.isfinite().all()


def test_without_a_config_an_8bit_decode_launches_the_quantized_default(monkeypatch):
    """The launch itself: tile, warps, stages and V widening of the decode kernel, by read path (TMA
    over 64-token blocks, the pointer path over 16-token ones; a prefill keeps its own launch)."""
    from kvcore_triton import attention

    launched, kernels = [], {"decode": attention._decode_split_kernel, "varlen": attention._varlen_kernel}

    def recording(name):
        class Recording:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launched.append((name, kwargs["TILE"], kwargs["num_warps"], kwargs["num_stages"],
                                     kwargs.get("STAGE_V")))
                    return kernels[name][grid](*args, **kwargs)
                return launch
        return Recording()

    def knobs(config):
        return config.tile, config.num_warps, config.num_stages, config.stage_v

    monkeypatch.setattr(attention, "_decode_split_kernel", recording("decode"))
    monkeypatch.setattr(attention, "_varlen_kernel", recording("varlen"))
    for config in (None, KernelConfig()):
        out, ref = _both("fp8_e4m3", "LBNHC", ([130, 64], [1, 1]), block_size=64, config=config)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    _both("int8_per_token_head", "LBNHC", ([130, 64], [1, 1]), block_size=64, config=None)
    _both("fp8_per_token_head", "LBNHC", ([130, 64], [1, 1]), block_size=16, config=None)
    _both("int8_per_token_head", "LBNHC", MIXED, block_size=64, config=None)
    plain = KernelConfig()
    tma, pointer = knobs(attention.QUANT_DECODE_TMA), knobs(attention.QUANT_DECODE_POINTER)
    assert launched == [("decode", *tma), ("decode", 64, attention.DECODE_WARPS, plain.num_stages, False),
                        ("decode", *tma), ("decode", *pointer),
                        ("varlen", 64, attention.VARLEN_WARPS, plain.num_stages, None)]
    assert len({tma, pointer, knobs(plain)}) == 3
