"""kvcore-triton's fused gated RMS norm equals transformers' gated norms of Mamba2 mixers (grouped
or not, float32 or 16-bit, a gate that is a strided view of the projection) and leaves every other
module to its own code."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvcore.testing import DEVICE
from kvcore_triton.norm_kernels import fused_gated_norm, gated_norm
from kvcore_triton.scan_kernels import runs_on

transformers = pytest.importorskip("transformers")

from kvcore.hf.models import model_config, random_model  # noqa: E402

pytestmark = pytest.mark.skipif(not runs_on(torch.device(DEVICE)), reason="kvcore-triton's kernels do not run here")
ARCHS = ["bamba", "granitemoehybrid", "nemotron_h"]


@pytest.fixture(scope="module")
def norm_classes():
    """The gated norm class of each architecture's Mamba2 mixer, in the installed transformers."""
    found = {}
    for arch in ARCHS:
        model = random_model(model_config(arch))
        found[arch] = type(next(m for m in model.modules() if hasattr(m, "A_log")).norm)
    return found


def random_norm(kind, dim, group, dtype, seed):
    if "group_size" in inspect.signature(kind.__init__).parameters:
        norm = kind(dim, group_size=group, eps=1e-5)
    elif group == dim:
        norm = kind(dim, eps=1e-5)
    else:
        pytest.skip(f"{kind.__name__} has no groups in this transformers")
    norm = norm.to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group", [96, 32])
@pytest.mark.parametrize("weights, inputs", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16)])
def test_the_fused_norm_is_the_modules(norm_classes, arch, group, weights, inputs):
    dim = 96
    norm = random_norm(norm_classes[arch], dim, group, weights, seed=group)
    gen = torch.Generator().manual_seed(7)
    y = (3 * torch.randn(4, 5, dim, generator=gen)).to(device=DEVICE, dtype=inputs)
    projected = torch.randn(4, 5, dim + 11, generator=gen).to(device=DEVICE, dtype=weights)
    gate = projected[..., 5 : 5 + dim]  # NOTE: a split of the projection, as the mixers pass it
    with torch.inference_mode():
        got, want = fused_gated_norm(norm, y, gate), norm(y, gate)
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    # NOTE: float32 sums in another order; 16-bit results may round one step apart (a float32 result:
    # the 16-bit weight times the normalized float32 values)
    step = 1e-5 if want.dtype == torch.float32 else 2 * torch.finfo(want.dtype).eps
    assert (got.float() - want.float()).abs().max() <= step * want.float().abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_float32_models_norm_runs_its_own_code(norm_classes, arch):
    # NOTE: float32 models' tokens equal transformers': their sums keep the module's order
    norm = random_norm(norm_classes[arch], 64, 64, torch.float32, seed=3)
    y, gate = torch.randn(2, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)
    assert fused_gated_norm(norm, y, gate) is None
    assert torch.equal(gated_norm(norm, y, gate), norm(y, gate))


def test_other_modules_and_patched_norms_run_their_own_code(norm_classes):
    granite = norm_classes["granitemoehybrid"]
    grouped = "group_size" in inspect.signature(granite.__init__).parameters
    norm = random_norm(granite, 64, 64, torch.bfloat16, seed=1)
    y, gate = (torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))

    class Mine(granite):  # NOTE: a subclass outside transformers may differ
        def forward(self, hidden_states, gate=None):
            return hidden_states * 2

    mine = Mine(64, **({"group_size": 64} if grouped else {})).to(DEVICE, torch.bfloat16)
    assert fused_gated_norm(mine, y, gate) is None
    assert torch.equal(gated_norm(mine, y, gate), y * 2)
    norm.forward = lambda hidden_states, gate=None: hidden_states - 1
    assert fused_gated_norm(norm, y, gate) is None and torch.equal(gated_norm(norm, y, gate), y - 1)
    assert fused_gated_norm(torch.nn.Identity(), y, gate) is None
    if grouped:
        uneven = random_norm(granite, 64, 48, torch.bfloat16, seed=2)  # NOTE: 64 channels in groups of 48
        assert fused_gated_norm(uneven, y, gate) is None
