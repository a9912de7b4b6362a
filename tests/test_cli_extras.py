"""Commands other distributions add (entry point group ``kvcore.cli``) never touch kvcore's own.

Real throw-away distributions (a dist-info directory on ``PYTHONPATH``) whose command module
hangs, exits, is interrupted or prints when imported; ``kvcore`` runs in a subprocess with a
short timeout, so a command that waits on one of them fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _plugin_dists import make_dist

EXTRAS = {
    "hangs": ("kvcore-hangs", "import time\ntime.sleep(3600)\n"),
    "exits": ("kvcore-exits", "import sys\nsys.exit(3)\n"),
    "interrupted": ("kvcore-interrupted", "raise KeyboardInterrupt\n"),
    "prints": ("kvcore-prints", '''
        import json
        print("printed by kvcore-prints when imported")


        def add_command(commands):
            print("printed by kvcore-prints when adding its command")
            parser = commands.add_parser("prints", help="print one JSON object")
            parser.add_argument("--json", action="store_true", help="JSON output")
            parser.set_defaults(func=lambda args: print(json.dumps({"ok": True})))
    '''),
}


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """One directory per extra command, each holding its distribution."""
    out = {}
    for name, (dist, source) in EXTRAS.items():
        module = f"kvcore_extra_{name}"
        out[name] = make_dist(tmp_path_factory.mktemp(name), dist, "1.0", {name: f"{module}:add_command"},
                              {module: source}, group="kvcore.cli")
    return out


def kvcore(paths, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-m", "kvcore", *argv], capture_output=True, text=True, env=env,
                              timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvcore {' '.join(argv)} waited on another distribution's command")


def test_built_in_commands_never_wait_on_or_print_for_an_extra_command(dists):
    every = dists.values()
    done = kvcore(every, "--help")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("    ")}
    assert set(EXTRAS) <= listed
    done = kvcore(every, "models", "--json")
    assert done.returncode == 0, done.stderr
    assert {p["preset"] for p in json.loads(done.stdout)} >= {"llama-3-8b", "gemma-3-27b"}
    assert "printed by" not in done.stdout + done.stderr
    # NOTE: completion imports them all, but gives up on one that hangs and keeps stdout its own
    done = kvcore(every, "completion", "bash")
    assert done.returncode == 0 and "printed by" not in done.stdout
    assert all(name in done.stdout for name in EXTRAS)


@pytest.mark.parametrize("name, error", [("exits", "SystemExit: 3"), ("interrupted", "KeyboardInterrupt")])
def test_an_extra_command_that_exits_when_imported_fails_alone_named(dists, name, error):
    dist = EXTRAS[name][0]
    done = kvcore([dists[name]], name, "run", "--fast")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"kvcore {name}: error: kvcore {name} could not be loaded from {dist} ({error})")
    assert f"uninstall {dist}" in done.stderr and "Traceback" not in done.stderr
    done = kvcore([dists[name]], name, "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["error"]["command"] == f"kvcore {name}"
    done = kvcore([dists[name]], "completion", "bash")
    assert done.returncode == 0 and name in done.stdout


def test_a_print_when_imported_reaches_no_json_output(dists):
    done = kvcore([dists["prints"]], "models", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)
    done = kvcore([dists["prints"]], "prints", "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == {"ok": True}
    assert "printed by kvcore-prints when imported" in done.stderr
