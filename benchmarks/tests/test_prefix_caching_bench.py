"""``kvcore bench pool``: both pools side by side, --json for tools, bad counts exit 2."""

from __future__ import annotations

import json

import pytest

from kvcore.cli import main


def test_json_has_every_operation_with_off_and_on_side_by_side(capsys):
    assert main(["bench", "pool", "--requests", "3", "--blocks", "4", "--repeat", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["op"]: r for r in result["rows"]}
    assert set(rows) == {"allocate", "take_new", "free", "cache", "free_evictable", "hit",
                         "allocate_evict", "hash"}  # fmt: skip
    for op in ("allocate", "take_new", "free"):
        r = rows[op]
        assert r["off_ns"] > 0 and r["on_ns"] > 0
        assert r["on_over_off"] == pytest.approx(r["on_ns"] / r["off_ns"])
    assert all(rows[op]["off_ns"] is None and rows[op]["on_ns"] > 0 for op in ("cache", "hit", "hash"))


def test_table_names_the_operations(capsys):
    assert main(["bench", "pool", "--requests", "2", "--blocks", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "get_cached_blocks (hit)" in out and "allocate (evicting)" in out


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--blocks", "-1"], ["--repeat", "x"]])
def test_non_positive_counts_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "pool", *argv])
    assert exc.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err


def test_a_round_too_large_is_refused_at_once(capsys):
    from kvcore_bench.options import POOL_MAX_BLOCKS

    assert main(["bench", "pool", "--requests", "100000"]) == 2
    err = capsys.readouterr().err
    assert "3,200,000 blocks per round" in err and f"{POOL_MAX_BLOCKS:,}" in err and "lower --requests" in err


def test_progress_is_reported_after_every_round():
    from kvcore_bench.pool import measure

    calls = []
    measure(2, 2, 4, 3, progress=lambda: calls.append(1))
    assert len(calls) == 3 + 2
