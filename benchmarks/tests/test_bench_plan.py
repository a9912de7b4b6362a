"""``kvcore bench plan``: bad sizes fail, --json for tools, refusals in full."""

from __future__ import annotations

import json

import pytest

from kvcore.cli import main
from kvcore.memory.planner import plan_kv_cache
from kvcore_bench.plan import hybrid_model_specs


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--repeat", "-1"], ["--memory", "-5GiB"]])
def test_non_positive_values_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "plan", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {argv[0]}:" in err


def test_json_has_one_row_per_layout(capsys):
    assert main(["bench", "plan", "--layers", "8", "--repeat", "2", "--memory", "1GiB",
                 "--layouts", "LBNHC,BLNHC", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in result["rows"]] == ["LBNHC", "BLNHC"]
    config = plan_kv_cache(hybrid_model_specs(8), "LBNHC", available_memory=1 << 30)
    assert result["rows"][0]["num_blocks"] == config.num_blocks
    assert result["rows"][0]["groups"] == len(config.kv_cache_groups)
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in result["rows"])


def test_a_refusal_is_printed_whole_and_all_refused_fails(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(ValueError) as refusal:
        plan_kv_cache(hybrid_model_specs(8), "LHBNC", available_memory=1 << 30)
    assert main(["bench", "plan", "--layers", "8", "--repeat", "2", "--memory", "1GiB",
                 "--layouts", "LHBNC"]) == 1
    captured = capsys.readouterr()
    assert " ".join(str(refusal.value).split()) in " ".join(captured.out.split())
    assert all(len(line) <= 80 for line in captured.out.splitlines())
    assert "every layout refused" in captured.err
