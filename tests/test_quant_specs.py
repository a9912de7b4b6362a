"""Quantized KV cache modes: what each stores, page bytes, and what is refused at the door."""

from __future__ import annotations

import pytest
import torch
from _quant_caches import MODES

from kvcore import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from kvcore.cli import KV_CACHE_DTYPES as CLI_MODES
from kvcore.specs.quant import KV_CACHE_DTYPES, kv_cache_dtype_of, parse_kv_cache_dtype, quantize_specs


@pytest.mark.parametrize("mode", [*MODES, "fp8"])
def test_each_mode_stores_its_dtype_and_quantization(mode):
    specs = {"attn": FullAttentionSpec(16, 4, 64, torch.bfloat16),
             "window": SlidingWindowSpec(16, 4, 64, torch.bfloat16, sliding_window=128)}
    out = quantize_specs(specs, mode)
    dtype, kv_quant = MODES[parse_kv_cache_dtype(mode)]
    for spec in out.values():
        assert (spec.dtype, spec.kv_quant) == (dtype, kv_quant)
    assert isinstance(out["window"], SlidingWindowSpec) and out["window"].sliding_window == 128
    assert kv_cache_dtype_of(out.values()) == parse_kv_cache_dtype(mode)


def test_fp8_is_e4m3_and_auto_keeps_the_specs():
    assert parse_kv_cache_dtype("fp8") == parse_kv_cache_dtype(" FP8_E4M3 ") == "fp8_e4m3"
    specs = {"attn": FullAttentionSpec(16, 4, 64, torch.bfloat16)}
    assert quantize_specs(specs, "auto") == specs
    assert kv_cache_dtype_of(specs.values()) == "auto"
    assert set(CLI_MODES) == set(KV_CACHE_DTYPES)  # the CLI's copy, kept without importing torch


@pytest.mark.parametrize("bad", ["fp4", "int8", "float8", "", "fp8_per_tensor"])
def test_unknown_modes_are_refused_naming_the_valid_ones(bad):
    with pytest.raises(ValueError, match="int8_per_token_head") as info:
        parse_kv_cache_dtype(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str"):
        parse_kv_cache_dtype(torch.float8_e4m3fn)


def test_state_caches_are_never_quantized():
    mamba = MambaSpec(16, ((4, 8), (8, 4)), (torch.bfloat16, torch.float32))
    out = quantize_specs({"attn": FullAttentionSpec(16, 2, 8, torch.bfloat16), "mixer": mamba},
                         "int8_per_token_head")
    assert out["mixer"] is mamba and out["attn"].kv_quant == "per_token_head"


@pytest.mark.parametrize("fields, match", [
    ({"dtype": torch.int8, "kv_quant": "per_tensor"}, "per_tensor"),
    ({"dtype": torch.float8_e5m2, "kv_quant": "per_token_head"}, "per_token_head"),
    ({"dtype": torch.bfloat16, "kv_quant": "per_tensor"}, "bfloat16"),
    ({"dtype": torch.int8, "kv_quant": "per_channel"}, "per_channel"),
    ({"dtype": torch.int8, "kv_quant": "per_token_head", "tokens_per_state": 2}, "one state per token"),
    ({"dtype": torch.int8, "kv_quant": "per_token_head", "head_size": 3}, "multiple of 4"),
])
def test_a_spec_refuses_a_quantization_its_dtype_cannot_hold(fields, match):
    args = {"dtype": torch.int8, "head_size": 16, **fields}
    dtype, head_size = args.pop("dtype"), args.pop("head_size")
    with pytest.raises(ValueError, match=match):
        FullAttentionSpec(16, 2, head_size, dtype, **args)


def test_a_spec_sized_in_bytes_cannot_be_requantized():
    spec = FullAttentionSpec(16, 1, 8, torch.bfloat16, state_content_bytes=64)
    with pytest.raises(ValueError, match="state_content_bytes"):
        quantize_specs({"indexer": spec}, "fp8")


@pytest.mark.parametrize("block_size", [1, 16, 48])
@pytest.mark.parametrize("heads, head_size, head_size_v", [(1, 64, None), (8, 128, None), (3, 96, 32)])
@pytest.mark.parametrize("mode", MODES)
def test_page_bytes(mode, block_size, heads, head_size, head_size_v):
    spec = quantize_specs({"a": FullAttentionSpec(block_size, heads, head_size, torch.bfloat16,
                                                  head_size_v=head_size_v)}, mode)["a"]
    content = head_size + (head_size if head_size_v is None else head_size_v)
    scales = 2 * 4 if spec.kv_quant == "per_token_head" else 0
    assert spec.page_size_bytes == block_size * heads * (content * spec.dtype.itemsize + scales)
    assert spec.state_content_size_bytes == content  # C stays the data: 8-bit elements, no widening


def test_mla_can_be_stored_fp8():
    spec = quantize_specs({"a": MLAAttentionSpec(64, 1, 576, torch.bfloat16)}, "fp8")["a"]
    assert spec.page_size_bytes == 64 * 576 and spec.kv_quant == "per_tensor"
