"""Both decode read paths of ``DECODE_VARIANTS`` (TMA where it applies, pointers) equal dense attention.

CPU runs use the Triton interpreter on tiny shapes; tile sizes below, equal to
and above the kernel block size reach every block-table path. A CUDA run also
checks the benchmark's shape class (head size 128, bf16), and when Triton's
CUDA compiler is installed each path is lowered for sm_90 without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_triton_backend import _close, _run

from kvcore_triton import KernelConfig
from kvcore_triton.attention import DECODE_VARIANTS

NAMES = sorted(DECODE_VARIANTS)
DECODE3 = ([23, 40, 9], [1, 1, 1])
WITH_IDLE = ([57, 40, 33], [1, 0, 1])  # an idle request (no new token) in a decode batch
LONG = ([140, 70], [1, 1])  # several 128-token manager blocks


def _config(name, **kwargs):
    return KernelConfig(**{**DECODE_VARIANTS[name], **kwargs})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("layout", "tile"), [("LBNHC", 16), ("BLNHC", 32)])
def test_variant_matches_reference(name, layout, tile):
    out, ref, *_ = _run(layout, 16, DECODE3, config=_config(name, tile=tile))
    _close(out, ref)


@pytest.mark.parametrize(("name", "tile"), [(n, t) for n in NAMES for t in (16, 64)])
def test_variant_manager_block_128_split_into_32(name, tile):
    out, ref, view, _ = _run("LBNHC", 128, LONG, ratio=4, config=_config(name, tile=tile))
    assert view.shape[2] == 32
    _close(out, ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("window", "splits"), [(None, 3), (21, 2)])
def test_variant_splits_windows_and_idle_requests(name, window, splits):
    """Unaligned window starts make partial first tiles; splits make partial last tiles."""
    out, ref, *_ = _run("BLNHC", 16, WITH_IDLE, sliding_window=window,
                        config=_config(name, tile=16, num_splits=splits))
    _close(out, ref)


def test_unpadded_head_and_half_precision():
    # head size 24 is not a power of two: TMA does not apply, the pointer path pads it.
    for name in NAMES:
        out, ref, *_ = _run("LBNHC", 16, DECODE3, head_size=24, config=_config(name, tile=16))
        _close(out, ref)
        out, ref, *_ = _run("BLNHC", 16, DECODE3, head_size=32, dtype=torch.bfloat16, config=_config(name, tile=16))
        _close(out, ref, tol=3e-2)


def test_variant_options_are_validated():
    with pytest.raises(TypeError, match="tma"):
        KernelConfig(tma=1)
    with pytest.raises(TypeError):
        KernelConfig(kv_load="early")  # a removed variant (never faster on the H200)
    assert KernelConfig() == KernelConfig(**DECODE_VARIANTS["base"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_variant_bf16(name, block_size):
    reqs = ([300, 1000, 77, 513], [1, 1, 0, 1])
    for layout in ("LBNHC", "BLNHC"):
        for tile, splits in ((64, 1), (128, None), (32, 2)):
            out, ref, *_ = _run(layout, block_size, reqs, q_heads=8, head_size=128, dtype=torch.bfloat16,
                                device="cuda", config=_config(name, tile=tile, num_splits=splits))
            _close(out, ref, tol=3e-2)
    out, ref, *_ = _run("LBNHC", block_size, reqs, q_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda",
                        sliding_window=100, config=_config(name, tile=64, num_splits=2))
    _close(out, ref, tol=3e-2)


def _lower_for_sm90(name, tile, block_size):
    """Compile a variant for sm_90 in a subprocess (the interpreter may be on here); its summary."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = Path(__file__).with_name("sm90_compile.py")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(script), name, str(tile), str(block_size), "4", "3"],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode and "ptxas" in done.stderr.lower():
        pytest.skip(f"no usable ptxas: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[0])


@pytest.mark.parametrize(("tile", "block_size"), [(64, 16), (32, 64)])
def test_pointer_path_lowers_for_sm90(tile, block_size):
    """K/V tiles stream through async copies on a (request, KV head, split) grid."""
    info = _lower_for_sm90("pointer", tile, block_size)
    assert info["async_copies"] > 0 and info["cp_async"] > 0 and info["tma_copies"] == 0
    assert info["grid_dims"] == 3, info


@pytest.mark.parametrize(("tile", "block_size", "tma"), [(64, 64, True), (32, 64, True), (64, 16, False)])
def test_default_config_lowers_to_tma_where_the_tile_fits_a_block(tile, block_size, tma):
    info = _lower_for_sm90("base", tile, block_size)
    assert (info["tma_copies"] > 0) == tma, info
    assert (info["cp_async"] > 8) != tma, info  # the pointer path streams K/V with cp.async
    # The default grid order: KV heads side by side (1-D grid) with TMA, request-major (3-D) otherwise.
    assert info["grid_dims"] == (1 if tma else 3), info
