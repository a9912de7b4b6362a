"""`kvcore plan` on every preset, through kvcore.cli.main."""

from __future__ import annotations

import argparse
import json

import pytest

from kvcore.cli import main
from kvcore.cli.plan import parse_memory

GIB = 1 << 30


def _page(heads, block, head_size, v_size, itemsize):
    return heads * block * (head_size + v_size) * itemsize


# bytes per block from the models' shapes: layers of the largest group x the common page
EXPECTED = {
    "llama-3-8b": dict(groups=1, bpb=32 * _page(8, 16, 128, 128, 2), min_block=16, fixed=0),
    "gemma-3-27b": dict(groups=7, bpb=10 * _page(16, 16, 128, 128, 2), min_block=16, fixed=0),
    "deepseek-v3": dict(groups=1, bpb=61 * _page(1, 64, 576, 0, 2), min_block=64, fixed=0),
    # attention page at 144 tokens; Mamba pages (573,440 bytes) are padded up to it
    "jamba-1.5-mini": dict(groups=8, bpb=4 * _page(8, 144, 128, 128, 2), min_block=144, fixed=7),
}


def _plan_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
@pytest.mark.parametrize("layout", ["BLNHC", "LBNHC"])
def test_plan_presets_json(capsys, preset, layout):
    want = EXPECTED[preset]
    plan = _plan_json(capsys, preset, "--memory", "40GiB", "--layout", layout)
    assert plan["layout"] == layout
    assert plan["bytes_per_block"] == want["bpb"]
    assert plan["num_blocks"] == 40 * GIB // want["bpb"]
    assert plan["total_bytes"] == plan["num_blocks"] * want["bpb"] <= 40 * GIB
    assert len(plan["groups"]) == want["groups"]
    assert sum(g["num_layers"] for g in plan["groups"]) == plan["num_layers"]
    assert {t["size"] for t in plan["tensors"]} == {plan["total_bytes"]}
    attn_groups = want["groups"] - want["fixed"]
    capacity = (plan["num_blocks"] - want["fixed"]) * want["min_block"] // attn_groups
    assert plan["token_capacity"] == capacity
    for t in plan["tensors"]:
        if layout == "BLNHC":
            assert t["block_stride"] == want["bpb"]
        else:
            assert t["layer_stride"] == plan["num_blocks"] * t["block_stride"]


def test_plan_table_output(capsys):
    assert main(["plan", "gemma-3-27b", "--memory", "40GiB", "--layout", "BLNHC"]) == 0
    out = capsys.readouterr().out
    assert "KV cache groups (BLNHC)" in out and "SlidingWindow" in out
    assert "5,11,17,23,29,35" in out.replace("\n", "").replace("│", "").replace(" ", "")
    assert f"{40 * GIB // (10 * _page(16, 16, 128, 128, 2)):,}" in out


def test_num_blocks_and_block_size(capsys):
    plan = _plan_json(capsys, "llama-3-8b", "--num-blocks", "7", "--block-size", "32")
    assert plan["num_blocks"] == 7
    assert plan["bytes_per_block"] == 32 * _page(8, 32, 128, 128, 2)
    assert plan["token_capacity"] == 7 * 32


def test_model_from_a_path(capsys, tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(
        'name = "tiny"\nnum_layers = 3\n[types.a]\nkind = "full"\n'
        'num_kv_heads = 1\nhead_size = 4\ndtype = "float32"\n'
    )
    plan = _plan_json(capsys, str(path), "--memory", "100000")
    assert plan["model"] == "tiny" and plan["bytes_per_block"] == 3 * _page(1, 16, 4, 4, 4)
    assert plan["num_blocks"] == 100000 // plan["bytes_per_block"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no-such-model", "--memory", "1GiB"], "presets:"),
        (["llama-3-8b", "--memory", "1MiB"], "needs 2097152 bytes"),
        (["jamba-1.5-mini", "--memory", "40GiB", "--layout", "LHBNC"], "such as LBNHC"),
    ],
)
def test_errors_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["llama-3-8b"],
        ["llama-3-8b", "--memory", "1GiB", "--num-blocks", "4"],
        ["llama-3-8b", "--memory", "lots"],
        ["llama-3-8b", "--memory", "1GiB", "--layout", "XYZ"],
    ],
)
def test_bad_arguments(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "text, value",
    [("40GiB", 40 * GIB), ("512MiB", 512 << 20), ("80GB", 80 * 10**9), ("1.5G", 3 * GIB // 2),
     ("4096", 4096), ("2 kib", 2048)],
)
def test_parse_memory(text, value):
    assert parse_memory(text) == value


def test_parse_memory_rejects_junk():
    with pytest.raises(argparse.ArgumentTypeError, match="40GiB"):
        parse_memory("12XB")
