"""``kvcore plugins``: lists and health-checks every plugin, broken ones with their error.

It never crashes; it exits 1 when a plugin failed, conflicts or answers a hook badly.
"""

from __future__ import annotations

import json

import pytest
from _plugin_dists import backend_plugin_source, clean_plugin_env, make_dist  # noqa: F401

from kvcore.cli import main

KEYS = {"name", "distribution", "version", "hooks", "backends", "status", "error"}


@pytest.fixture
def dists(tmp_path, monkeypatch):
    make_dist(tmp_path, "good-dist", "1.2", {"good": "fakeplug_good"},
              {"fakeplug_good": backend_plugin_source("good-attn", "[16, 32]")})
    make_dist(tmp_path, "bad-dist", "0.0.1", {"bad": "fakeplug_bad"},
              {"fakeplug_bad": "raise RuntimeError('[bold]missing kernel[/bold]')\n"})
    make_dist(tmp_path, "off-dist", "9", {"off": "fakeplug_off"},
              {"fakeplug_off": backend_plugin_source("off-attn")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "good,bad,off")
    monkeypatch.setenv("KVCORE_BLOCK_PLUGINS", "off")


def _json(capsys, code=1):
    assert main(["plugins", "--json"]) == code
    return {item["name"]: item for item in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("strict", ["0", "1"])
def test_json_lists_loaded_failed_and_blocked(dists, capsys, monkeypatch, strict):
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", strict)
    items = _json(capsys)
    assert {"good", "bad", "off"} <= set(items) and all(KEYS <= set(i) for i in items.values())
    # installed plugins outside the allow-list are listed, not loaded
    assert all(i["status"] == "disabled" for n, i in items.items() if n not in ("good", "bad", "off"))
    good, bad, off = items["good"], items["bad"], items["off"]
    assert (good["distribution"], good["version"], good["status"]) == ("good-dist", "1.2", "loaded")
    assert good["backends"] == ["good-attn"] and "kvcore_register_backends" in good["hooks"]
    assert good["error"] is None
    assert good["kernel_block_sizes"] == {"good-attn": [16, 32]} and good["layouts"] == {"good-attn": None}
    assert (bad["distribution"], bad["version"], bad["status"]) == ("bad-dist", "0.0.1", "failed")
    assert "missing kernel" in bad["error"] and bad["backends"] == [] and bad["hooks"] == []
    assert off["status"] == "blocked"


@pytest.mark.parametrize("columns", ["80", "250"])
def test_records_show_broken_plugin_error_without_cutting_words(dists, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert main(["plugins"]) == 1
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= int(columns) and "\u2026" not in out
    words = out.split()
    for text in ("good-dist", "good-attn:", "[failed]", "[blocked]", "[bold]missing", "kernel[/bold])",
                 "register_backends,", "supported_kernel_block_sizes", "fakeplug_good"):
        assert text in words, text


def test_wrong_type_and_raising_hooks_make_the_plugin_unhealthy(tmp_path, monkeypatch, capsys):
    wrong = backend_plugin_source("wrong-attn", "'16, 32'")
    raising = backend_plugin_source("raise-attn", extra=(
        "\n@kvcore.hookimpl\ndef kvcore_supported_layouts(backend, spec):\n"
        "    if backend is Backend:\n        raise LookupError('no layout table')\n"
    ))
    make_dist(tmp_path, "wrong-dist", "0.1", {"wrong": "fakeplug_wrong"}, {"fakeplug_wrong": wrong})
    make_dist(tmp_path, "raise-dist", "0.2", {"raiser": "fakeplug_raiser"}, {"fakeplug_raiser": raising})
    make_dist(tmp_path, "fine-dist", "1.0", {"fine": "fakeplug_fine"},
              {"fakeplug_fine": backend_plugin_source("fine-attn", "[MultipleOf(16)]")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "wrong,raiser,fine")
    items = _json(capsys)
    assert items["wrong"]["status"] == "unhealthy" and "'16, 32'" in items["wrong"]["error"]
    assert "kvcore_supported_kernel_block_sizes" in items["wrong"]["error"]
    assert items["raiser"]["status"] == "unhealthy" and "LookupError: no layout table" in items["raiser"]["error"]
    assert items["fine"]["status"] == "loaded"
    assert items["fine"]["kernel_block_sizes"] == {"fine-attn": [{"multiple_of": 16}]}
    monkeypatch.setenv("KVCORE_PLUGINS", "fine")
    assert _json(capsys, code=0)["fine"]["error"] is None


def test_conflicting_backend_names_exit_1(tmp_path, monkeypatch, capsys):
    for dist, entry in (("one-dist", "one"), ("two-dist", "two")):
        make_dist(tmp_path, dist, "1.0", {entry: f"fakeplug_{entry}"},
                  {f"fakeplug_{entry}": backend_plugin_source("same-attn", "[16]")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "one,two")
    items = _json(capsys)
    assert items["one"]["status"] == items["two"]["status"] == "conflict"
    assert "two-dist" in items["one"]["error"] and "one-dist" in items["two"]["error"]


def test_autoload_disabled_listing_is_not_healthy(dists, capsys, monkeypatch):
    """With every plugin kept from loading no backend is usable: exit 1, saying why."""
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    items = _json(capsys, code=1)
    assert {i["status"] for i in items.values()} == {"disabled"}
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert "no attention backend is usable" in captured.err and "unset it" in captured.err
    assert "KVCORE_DISABLE_PLUGIN_AUTOLOAD=1" in captured.err and "need attention (exit 1)" in captured.out


def test_sizes_are_ints_or_multiple_of_objects_in_json_and_words_in_text(tmp_path, monkeypatch, capsys):
    make_dist(tmp_path, "mix-dist", "1.0", {"mix": "fakeplug_mix"},
              {"fakeplug_mix": backend_plugin_source("mix-attn", "[16, MultipleOf(8)]")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "mix")
    assert _json(capsys, code=0)["mix"]["kernel_block_sizes"] == {"mix-attn": [16, {"multiple_of": 8}]}
    assert main(["plugins"]) == 0
    assert "kernel block sizes 16, multiple of 8;" in " ".join(capsys.readouterr().out.split())


def test_an_allow_list_that_matches_nothing_is_not_healthy(dists, capsys, monkeypatch):
    """KVCORE_PLUGINS=typo disables every plugin: the check says so and exits 1."""
    monkeypatch.setenv("KVCORE_PLUGINS", "good,typo")
    monkeypatch.delenv("KVCORE_BLOCK_PLUGINS")
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert "typo" in captured.err and "good" in captured.out
    monkeypatch.setenv("KVCORE_PLUGINS", "good")
    assert main(["plugins"]) == 0
    assert capsys.readouterr().err == ""


def test_a_plugin_whose_kernel_library_is_not_installed_says_so(tmp_path, monkeypatch, capsys):
    for dist, name, kernels in (("lib-missing", "missing", "no-such-kernel-lib>=1.0"),
                                ("lib-present", "present", "torch")):
        make_dist(tmp_path, dist, "1.0", {name: f"fakeplug_{name}"},
                  {f"fakeplug_{name}": backend_plugin_source(f"{name}-attn", "[16]")})
        metadata = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info" / "METADATA"
        metadata.write_text(metadata.read_text() + "Requires-Dist: kvcore\nProvides-Extra: kernels\n"
                            f'Requires-Dist: {kernels}; extra == "kernels"\n'
                            'Requires-Dist: no-such-test-tool; extra == "test"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "missing,present")
    monkeypatch.setenv("COLUMNS", "80")
    items = _json(capsys, code=0)
    assert items["missing"]["kernels_missing"] == ["no-such-kernel-lib"]  # not the test extra's tool
    assert items["present"]["kernels_missing"] == []
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    record = out.split("missing  [loaded]")[1].split("\n\n")[0]
    assert "note" in record and "no-such-kernel-lib not installed" in " ".join(record.split())
    assert "'lib-missing[kernels]'" in " ".join(record.split())
    assert "note" not in out.split("present  [loaded]")[1].split("\n\n")[0]
