"""The reference quantization: what a stored row holds, and how close attention over it is."""

from __future__ import annotations

import pytest
import torch

from kvcore.plugins.backend import KVQuantState
from kvcore_torch.accuracy import attention_error
from kvcore_torch.quant import dequantize, max_value, quantize, to_storage

STORAGE = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
#: The accuracy targets: rel. L2 of attention over the quantized cache against float64 attention.
TARGETS = {"int8_per_token_head": 1e-2, "fp8_per_token_head": 4e-2, "fp8": 4e-2, "fp8_e5m2": 4e-2}


@pytest.mark.parametrize("dtype", STORAGE)
def test_values_beyond_the_range_saturate(dtype):
    x = torch.tensor([1e30, -1e30, 1e6, -3.0, 0.0, float("inf"), -float("inf")])
    stored = to_storage(x, dtype).float()
    limit = max_value(dtype)
    assert stored.isfinite().all()
    assert stored.tolist()[:2] == [limit, -limit] and stored[-2:].tolist() == [limit, -limit]
    assert stored[3] == -3.0 and stored[4] == 0.0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_per_token_head_scale_is_amax_over_max_and_zero_rows_keep_zero(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 32, generator=gen) * torch.logspace(-3, 3, 6)[:, None, None]
    x[2, 1] = 0.0
    state = KVQuantState("per_token_head", dtype)
    stored, scales = quantize(x, state, 1.0)
    limit = max_value(dtype)
    torch.testing.assert_close(scales, x.abs().amax(-1) / limit)
    assert scales[2, 1] == 0 and (stored[2, 1].float() == 0).all()
    assert (stored.float().abs().amax(-1)[scales > 0] == limit).all()
    back = dequantize(stored, scales)
    assert back[2, 1].eq(0).all() and not back.isnan().any()  # no 0/0
    step = scales[..., None] * (1.0 if dtype == torch.int8 else 2.0**-3 * limit)
    assert ((back - x).abs() <= step / 2 + 1e-12).all()


def test_integers_round_half_away_from_zero():
    assert to_storage(torch.tensor([0.5, -0.5, 1.5, -2.5, 2.49]), torch.int8).tolist() == [1, -1, 2, -3, 2]


@pytest.mark.parametrize("mode", list(TARGETS))
def test_attention_over_each_mode_is_within_its_target_of_exact_attention(mode):
    errors = [attention_error(mode, seed=seed) for seed in range(3)]
    assert max(errors) < TARGETS[mode], errors
    assert min(errors) > 0  # NOTE: a quantized cache is not exact: the harness measures something
    assert attention_error("auto") < 1e-6


def test_finer_storage_is_more_accurate():
    errors = {m: attention_error(m, head_size=32, context=128) for m in ("int8_per_token_head", "fp8", "fp8_e5m2")}
    assert errors["int8_per_token_head"] < errors["fp8"] < errors["fp8_e5m2"]
