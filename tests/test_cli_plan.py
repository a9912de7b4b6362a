"""`kvcore plan` on every preset, through kvcore.cli.main."""

from __future__ import annotations

import json
import re

import pytest

from kvcore.cli import main

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
    # Block 0 is the null block; each state group takes one block; each attention
    # group takes ceil(T / block) blocks of the shared pool.
    attn_groups = want["groups"] - want["fixed"]
    capacity = (plan["num_blocks"] - 1 - want["fixed"]) // attn_groups * want["min_block"]
    assert plan["token_capacity"] == capacity
    assert plan["usable_blocks"] == plan["num_blocks"] - 1
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
    assert "token capacity:  74,896 tokens in one sequence" in out  # 7 groups x 4,681 blocks x 16


def test_num_blocks_and_block_size(capsys):
    plan = _plan_json(capsys, "llama-3-8b", "--num-blocks", "7", "--block-size", "32")
    assert plan["num_blocks"] == 7
    assert plan["bytes_per_block"] == 32 * _page(8, 32, 128, 128, 2)
    assert plan["token_capacity"] == 6 * 32  # block 0 is the null block


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
        (["llama-3-8b", "--memory", "1MiB"], "needs 2 MiB (2,097,152 bytes)"),
        (["llama-3-8b", "--num-blocks", "1"], "plan at least 2 blocks"),
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


    assert "usage: kvcore plan" in capsys.readouterr().err


def test_two_blocks_hold_one_block_of_tokens(capsys):
    # Block 0 is the null block: of 2 blocks, one 16-token block is usable.
    assert _plan_json(capsys, "llama-3-8b", "--num-blocks", "2")["token_capacity"] == 16
    main(["plan", "llama-3-8b", "--num-blocks", "2"])
    assert "token capacity:  16 tokens" in capsys.readouterr().out


def test_negative_memory_is_a_kvcore_message_not_argparse_confusion(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3-8b", "--memory", "-5GiB"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "argument --memory: invalid size '-5GiB'" in err and "at least one byte" in err
    assert "expected one argument" not in err


def test_block_size_zero_blames_the_option_not_the_model_file(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3-8b", "--memory", "1GiB", "--block-size", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --block-size: must be a positive integer, got 0" in err
    assert "llama-3-8b.toml" not in err


def _mamba_only(tmp_path, layers=4):
    path = tmp_path / "ssm.toml"
    path.write_text(
        f'name = "ssm"\nnum_layers = {layers}\n[types.m]\nkind = "mamba"\n'
        'shapes = [[3, 64], [64, 16]]\ndtypes = ["bfloat16", "float32"]\n'
    )
    return str(path)


def test_state_only_model_reports_sequences_not_zero_tokens(capsys, tmp_path):
    model = _mamba_only(tmp_path)
    plan = _plan_json(capsys, model, "--num-blocks", "9")
    # 8 usable blocks, one group of 4 Mamba layers: one block per sequence.
    assert plan["state_only"] and plan["sequence_capacity"] == 8
    main(["plan", model, "--num-blocks", "9"])
    out = capsys.readouterr().out
    assert "8 sequences of any length" in out and "token capacity" not in out


def _padding(capsys, block_size):
    plan = _plan_json(capsys, "jamba-1.5-mini", "--memory", "40GiB", "--block-size", str(block_size))
    return plan, max(g["padding_percent"] for g in plan["groups"])


def test_padding_is_shown_per_group_and_warned_with_a_remedy_that_holds(capsys):
    plan, worst = _padding(capsys, 16)
    attn = next(g for g in plan["groups"] if g["kind"] == "FullAttentionSpec")
    # 16 tokens x 8 heads x 256 values x 2 bytes = 64 KiB, padded to the 560 KiB Mamba page.
    assert attn["padding_bytes"] == 4 * (573_440 - 65_536)
    assert attn["padding_percent"] == pytest.approx(100 * (1 - 65_536 / 573_440), abs=0.01)
    assert worst == attn["padding_percent"] and len(plan["warnings"]) == 1
    main(["plan", "jamba-1.5-mini", "--memory", "40GiB", "--block-size", "16"])
    captured = capsys.readouterr()
    assert "88.6%" in captured.out
    warning = " ".join(captured.err.split())
    suggested = int(re.search(r"--block-size (\d+) pads at most", warning).group(1))
    assert "warning: group 7 (FullAttention)" in warning and "88.6%" in warning
    # The remedy is the smallest multiple of 16 that pads 10% or less, and it does.
    tried = {b: _padding(capsys, b)[1] for b in range(16, suggested + 1, 16)}
    assert tried[suggested] <= 10 and all(p > 10 for b, p in tried.items() if b < suggested)


def test_no_padding_warning_for_the_preset_block_size(capsys):
    plan, worst = _padding(capsys, 144)
    assert 0 < worst <= 10 and plan["warnings"] == []


def test_sliding_window_note_says_what_the_window_means(capsys):
    main(["plan", "gemma-3-27b", "--memory", "40GiB"])
    out = " ".join(capsys.readouterr().out.split())
    # ceil((1024 - 1) / 16) + 1 blocks hold the last 1,024 tokens of a sequence.
    assert "groups 0-5: sliding window of 1,024 tokens" in out
    assert "keeps at most 65 blocks" in out and "no window discount" in out


def test_sizes_print_in_human_units(capsys):
    plan = _plan_json(capsys, "deepseek-v3", "--memory", "100TiB")
    main(["plan", "deepseek-v3", "--memory", "100TiB"])
    out = capsys.readouterr().out
    assert f"total:           100 TiB ({plan['total_bytes']:,} bytes)" in out
    for value, unit in re.findall(r"([0-9][0-9,.]*) (KiB|MiB|GiB|TiB)\b", out):
        number = float(value.replace(",", ""))
        assert 1 <= number < 1024 or unit == "TiB", (value, unit)
    # Raw byte counts appear only beside the human form.
    assert len(re.findall(r"\d bytes\b", out)) == len(re.findall(r"[KMGT]iB \([0-9,]+ bytes\)", out)) > 0


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_plan_output_fits_80_columns_without_cutting_words(capsys, monkeypatch, preset):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", preset, "--memory", "40GiB", "--block-size", "16"]) == 0
    captured = capsys.readouterr()
    for line in (captured.out + captured.err).splitlines():
        assert len(line) <= 80 and "…" not in line, line
    kinds = {"llama-3-8b": "FullAttention", "gemma-3-27b": "SlidingWindow",
             "deepseek-v3": "MLAAttention", "jamba-1.5-mini": "Mamba"}
    assert kinds[preset] in captured.out.split()


def test_spec_command_with_a_model_file_path(capsys, monkeypatch):
    """The documented command: a TOML path under examples/models/ plans like the preset of that name."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    by_path = _plan_json(capsys, "examples/models/llama-3-8b.toml", "--memory", "40GiB", "--layout", "BLNHC")
    by_name = _plan_json(capsys, "llama-3-8b", "--memory", "40GiB", "--layout", "BLNHC")
    assert Path(by_path.pop("source")).resolve() == Path(by_name.pop("source")).resolve()
    assert by_path == by_name
    assert by_path["num_blocks"] == 40 * GIB // EXPECTED["llama-3-8b"]["bpb"]


def test_two_state_groups_in_two_blocks_say_no_sequence_fits(capsys, tmp_path):
    """One block per state group: 2 groups need 2 blocks, and a pool of 2 has 1 usable."""
    path = tmp_path / "two-states.toml"
    path.write_text(
        'name = "two state groups"\nnum_layers = 2\npattern = ["a", "b"]\n'
        '[types.a]\nkind = "mamba"\nshapes = [[4, 64]]\ndtypes = ["float32"]\n'
        '[types.b]\nkind = "mamba"\nblock_size = 32\nshapes = [[4, 64]]\ndtypes = ["float32"]\n'
    )
    plan = _plan_json(capsys, str(path), "--num-blocks", "2")
    assert plan["state_only"] and plan["sequence_capacity"] == 0 and plan["token_capacity"] == 0
    assert plan["blocks_for_one_token"] == 2
    main(["plan", str(path), "--num-blocks", "2"])
    out = " ".join(capsys.readouterr().out.split())
    assert "no sequence fits: one sequence needs 2 blocks (one per state group) but only 1 are usable" in out
    assert "plan at least 3 blocks" in out and "sequences of any length" not in out
    main(["plan", str(path), "--num-blocks", "3"])
    assert "1 sequences of any length" in " ".join(capsys.readouterr().out.split())


def test_explain_adds_the_negotiation_and_leaves_the_plan_as_it_was(capsys, monkeypatch, request):
    from kvcore.plugins import registry

    monkeypatch.setenv("KVCORE_PLUGINS", "torch,triton")  # NOTE: other installed plugins could outbid
    # NOTE: the default manager reads KVCORE_PLUGINS when built: built afresh here, forgotten after
    registry.default_plugin_manager.cache_clear()
    request.addfinalizer(registry.default_plugin_manager.cache_clear)
    monkeypatch.setattr("kvcore_triton._checks.INTERPRETED", True)  # NOTE: triton on CPU, as `make test` runs it
    assert main(["plan", "jamba-1.5-mini", "--memory", "1GiB", "--layout", "BLNHC"]) == 0
    plain = capsys.readouterr().out
    assert main(["plan", "jamba-1.5-mini", "--memory", "1GiB", "--layout", "BLNHC", "--explain"]) == 0
    explained = capsys.readouterr().out
    assert explained.startswith(plain) and "negotiated on cpu: layout BLNHC" in explained
    tail = explained[len(plain):]
    assert 'torch, picked by "auto"' in tail and "triton: priority -1" in tail
    assert "torch for FullAttentionSpec: kernel block sizes multiple of 1" in tail
    assert "BLNHC: meets every rule" in tail and "LBNHC: not tried" in tail
    assert "groups 0-6 (MambaSpec" in tail and "packed blocks keep the manager block size" in tail
    assert main(["plan", "llama-3-8b", "--num-blocks", "4", "--explain", "--device", "cuda", "--json"]) == 0
    explain = json.loads(capsys.readouterr().out)["explain"]
    assert 'triton, picked by "auto"' in explain and "kernel block sizes 64, 32, 16" in explain
