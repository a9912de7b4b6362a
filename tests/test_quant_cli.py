"""``kvcore plan --kv-cache-dtype`` and model files that name a KV cache mode."""

from __future__ import annotations

import json

import pytest

from kvcore.cli import main


def _plan(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_8bit_cache_holds_about_twice_the_tokens_of_bf16(capsys):
    plans = {mode: _plan(capsys, "llama-3-8b", "--memory", "40GiB", "--kv-cache-dtype", mode)
             for mode in ("auto", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head")}
    bf16 = plans["auto"]["token_capacity"]
    assert plans["auto"]["kv_cache_dtype"] == "auto" and plans["auto"]["bytes_per_token"] == 32 * 8 * 256 * 2
    for mode in ("fp8", "fp8_e5m2"):
        assert plans[mode]["token_capacity"] >= 1.99 * bf16
        assert plans[mode]["bytes_per_token"] == 32 * 8 * 256
    for mode in ("int8_per_token_head", "fp8_per_token_head"):
        assert plans[mode]["token_capacity"] >= 1.93 * bf16
        assert plans[mode]["bytes_per_token"] == 32 * 8 * (256 + 8)  # 8 scale bytes per token and head
        assert plans[mode]["kv_cache_dtype"] == mode
    assert plans["fp8"]["kv_cache_dtype"] == "fp8_e4m3"


def test_the_table_shows_mode_bytes_per_token_and_capacity(capsys):
    assert main(["plan", "llama-3-8b", "--memory", "40GiB", "--kv-cache-dtype", "int8_per_token_head"]) == 0
    out = capsys.readouterr().out
    assert "KV cache dtype:  int8_per_token_head" in out and "66 KiB (67,584 bytes)" in out
    assert "635,472 tokens" in out


def test_a_model_file_names_its_mode_and_the_flag_overrides_it(capsys, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('num_layers = 2\nkv_cache_dtype = "fp8"\n[types.a]\nkind = "full"\nnum_kv_heads = 2\n'
                    'head_size = 64\ndtype = "bfloat16"\n[types.m]\nkind = "mamba"\nshapes = [[4, 8]]\n'
                    'dtypes = ["bfloat16"]\n')
    path.write_text(path.read_text().replace("num_layers = 2", 'num_layers = 2\npattern = ["a", "m"]'))
    plan = _plan(capsys, str(path), "--num-blocks", "4")
    assert plan["kv_cache_dtype"] == "fp8_e4m3" and plan["bytes_per_token"] == 2 * 128
    plan = _plan(capsys, str(path), "--num-blocks", "4", "--kv-cache-dtype", "auto")
    assert plan["kv_cache_dtype"] == "auto" and plan["bytes_per_token"] == 2 * 128 * 2


def test_a_bad_mode_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3-8b", "--memory", "1GiB", "--kv-cache-dtype", "fp4"])
    assert exc.value.code == 2
    assert "int8_per_token_head" in capsys.readouterr().err


def test_a_bad_mode_in_a_model_file_is_named(capsys, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('num_layers = 1\nkv_cache_dtype = "fp6"\n[types.a]\nkind = "full"\nnum_kv_heads = 2\n'
                    'head_size = 64\ndtype = "bfloat16"\n')
    assert main(["plan", str(path), "--num-blocks", "4"]) == 2
    assert "fp6" in capsys.readouterr().err
