"""``kvcore plugins``: lists every plugin, broken ones with their error, never crashes."""

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


def _json(capsys):
    assert main(["plugins", "--json"]) == 0
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
    assert (bad["distribution"], bad["version"], bad["status"]) == ("bad-dist", "0.0.1", "failed")
    assert "missing kernel" in bad["error"] and bad["backends"] == [] and bad["hooks"] == []
    assert off["status"] == "blocked"


def test_table_shows_broken_plugin_error(dists, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for text in ("good-dist", "good-attn", "failed", "blocked", "[bold]missing kernel[/bold]"):
        assert text in out


def test_autoload_disabled_listing(dists, capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    items = _json(capsys)
    assert {i["status"] for i in items.values()} == {"disabled"}
