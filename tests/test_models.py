"""TOML model descriptions and the presets shipped in kvcore/presets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from kvcore.model_files import PRESET_DIR, find_model, load_model_file, parse_model, preset_names
from kvcore.model_runner.binding import extract_layer_index
from kvcore.specs import FullAttentionSpec, MambaSpec, MLAAttentionSpec, MultipleOf, SlidingWindowSpec


def test_presets_are_listed():
    assert {"llama-3-8b", "gemma-3-27b", "deepseek-v3", "jamba-1.5-mini"} <= set(preset_names())


def test_llama():
    model = load_model_file("llama-3-8b")
    specs = list(model.kv_cache_specs.values())
    assert model.name == "Llama 3 8B" and len(specs) == 32
    assert all(s == specs[0] for s in specs) and isinstance(specs[0], FullAttentionSpec)
    assert specs[0].page_size_bytes == 8 * 16 * (128 + 128) * 2
    assert [extract_layer_index(n) for n in model.kv_cache_specs] == list(range(32))


def test_gemma_alternates_five_sliding_per_full():
    specs = load_model_file("gemma-3-27b").kv_cache_specs
    full = [extract_layer_index(n) for n, s in specs.items() if type(s) is FullAttentionSpec]
    sliding = [s for s in specs.values() if isinstance(s, SlidingWindowSpec)]
    assert full == list(range(5, 62, 6)) and len(sliding) == 52
    assert sliding[0].sliding_window == 1024


def test_deepseek_mla_shapes():
    specs = load_model_file("deepseek-v3").kv_cache_specs
    spec = next(iter(specs.values()))
    assert len(specs) == 61 and isinstance(spec, MLAAttentionSpec)
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v, spec.dtype) == (1, 576, 0, torch.bfloat16)
    assert spec.page_size_bytes == spec.block_size * 576 * 2


def test_jamba_mixes_mamba_and_attention():
    specs = load_model_file("jamba-1.5-mini").kv_cache_specs
    attn = [extract_layer_index(n) for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
    mamba = [s for n, s in specs.items() if n.endswith(".mixer")]
    assert attn == [4, 12, 20, 28] and len(mamba) == 28
    assert all(isinstance(s, MambaSpec) for s in mamba)
    assert mamba[0].page_size_bytes == 3 * 8192 * 2 + 8192 * 16 * 4


def test_block_size_override_and_path(tmp_path):
    path = find_model("llama-3-8b")
    model = load_model_file(str(path), block_size=32)
    assert {s.block_size for s in model.kv_cache_specs.values()} == {32}
    assert model.source == str(path)


def _types(**extra):
    return {"a": {"kind": "full", "num_kv_heads": 2, "head_size": 8, "dtype": "float16", **extra}}


def test_pattern_skips_layers_without_cache_and_fields_convert():
    data = {
        "num_layers": 5,
        "pattern": ["a", "-", "m"],
        "layer_name": "blocks.{index}.{module}",
        "types": {
            **_types(tokens_per_state="1/2", block_stride_alignment=8, block_size=32),
            "m": {"kind": "mamba", "shapes": [[4, 4]], "dtypes": ["float32"], "module": "ssm"},
        },
    }
    specs = parse_model(data)
    assert list(specs) == ["blocks.0.self_attn", "blocks.2.ssm", "blocks.3.self_attn"]
    a = specs["blocks.0.self_attn"]
    assert a.tokens_per_state == Fraction(1, 2) and a.block_stride_alignment == MultipleOf(8)
    assert a.block_size == 32 and specs["blocks.2.ssm"].block_size == 16


@pytest.mark.parametrize(
    "data, match",
    [
        ({"num_layers": 2, "types": {"a": {"kind": "lstm"}}}, "valid kinds: full, sliding"),
        ({"num_layers": 2, "types": _types(heads=3)}, r"unknown keys \['heads'\].*num_kv_heads"),
        ({"num_layers": 2, "types": _types(dtype="float33")}, "unknown dtype 'float33'"),
        ({"num_layers": 2, "types": _types(head_size=-1)}, r"types.a \(layer 0 and 1 more\):.*positive"),
        ({"num_layers": 0, "types": _types()}, "num_layers must be a positive integer"),
        ({"num_layers": 100_000_000, "types": _types()}, "num_layers = 100,000,000 is more than the 10,000"),
        ({"num_layers": 2, "types": _types(num_kv_heads=10**8, head_size=10**8)},
         r"types.a \(layer 0 and 1 more\): one block of one layer takes [0-9,]+ bytes.*check block_size, num_kv_heads"),
        ({"num_layers": 2, "block_size": 10**15, "types": _types()}, "more than 1,099,511,627,776"),
        ({"num_layers": 2, "types": _types(), "pattern": ["a", "b"]}, r"unknown types \['b'\]"),
        ({"num_layers": 2, "types": {**_types(), "b": _types()["a"]}}, "pattern must list"),
        ({"num_layers": 2, "types": _types(), "pattern": ["-"]}, "gives no layer a cache"),
        ({"num_layers": 2, "types": _types(), "layer_name": "x.{module}"}, "include {index}"),
        ({"num_layers": 2, "types": _types(), "layers": 3}, r"unknown top-level keys \['layers'\]"),
        ({"num_layers": 2}, r"\[types.NAME\]"),
    ],
)
def test_bad_descriptions(data, match):
    with pytest.raises(ValueError, match=match):
        parse_model(data)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("num_layers = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_model_file(bad)
    with pytest.raises(ValueError, match="presets: .*llama-3-8b"):
        load_model_file("llama-9")


def test_a_binary_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "weights.toml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match=rf"{path}: not a TOML model description.*binary"):
        load_model_file(path)


def test_a_missing_required_key_names_the_key_and_the_layer():
    data = {"num_layers": 6, "pattern": ["local", "a"],
            "types": {**_types(), "local": {**_types()["a"], "kind": "sliding"}}}
    with pytest.raises(ValueError) as exc:
        parse_model(data)
    message = str(exc.value)
    assert "types.local (layer 0 and 2 more)" in message and "needs the key sliding_window" in message
    assert "__init__" not in message


def test_unknown_keys_list_only_the_keys_of_that_kind():
    with pytest.raises(ValueError) as exc:
        parse_model({"num_layers": 2, "types": _types(heads=3)})
    takes = str(exc.value).split("takes: ")[1]
    assert "num_kv_heads" in takes and "head_size_v" in takes
    assert "sliding_window" not in takes and "attention_chunk_size" not in takes
    mamba = {"kind": "mamba", "shapes": [[4, 4]], "dtypes": ["float32"], "num_kv_heads": 2}
    with pytest.raises(ValueError, match=r"unknown keys \['num_kv_heads'\]") as exc:
        parse_model({"num_layers": 2, "types": {"m": mamba}})
    assert "head_size" not in str(exc.value).split("takes: ")[1]


def test_a_window_on_a_full_type_points_to_the_sliding_kind():
    with pytest.raises(ValueError, match="use kind = 'sliding'"):
        parse_model({"num_layers": 2, "types": _types(sliding_window=512)})


@pytest.mark.parametrize("bad", [0, -16, True, 2.5])
def test_a_bad_block_size_override_blames_the_override_not_the_file(bad):
    with pytest.raises(ValueError) as exc:
        load_model_file("llama-3-8b", block_size=bad)
    assert str(exc.value).startswith(f"block_size={bad!r} (the block size given for every layer type)")
    assert ".toml" not in str(exc.value)


ROOT = Path(__file__).resolve().parents[1]


def test_a_wheel_ships_the_presets_and_plans_them(tmp_path):
    # regression: presets lived in examples/, outside the package, and a wheel install had none
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kvcore", src / "kvcore", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
             "-q", "-w", str(tmp_path / "dist"), str(src)]
    done = subprocess.run(build, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("kvcore-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = {Path(n).stem for n in zf.namelist() if n.startswith("kvcore/presets/") and n.endswith(".toml")}
        zf.extractall(tmp_path / "site")
    assert shipped == set(preset_names()) and shipped == {p.stem for p in PRESET_DIR.glob("*.toml")}
    script = (
        "import kvcore.model_files, sys\nfrom kvcore.cli import main\n"
        "print(kvcore.model_files.PRESET_DIR)\nsys.exit(main(['plan', 'llama-3-8b', '--memory', '1GiB']))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == str(tmp_path / "site" / "kvcore" / "presets")
    assert "Llama 3 8B" in run.stdout and "0-31" in run.stdout
