"""Every distribution installs quietly in editable mode (``make demo`` / ``make test``).

setuptools prints an "Editable installation" warning for a flat layout unless the
project maps its root explicitly (``package-dir = {"" = "."}``): then ``pip install
-e`` writes a plain ``.pth`` and says nothing (issue #22: three warnings per install).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("project", [".", "plugins/kvcore-torch", "plugins/kvcore-triton", "benchmarks"])
def test_each_project_maps_its_root_for_a_quiet_editable_install(project):
    config = tomllib.loads((ROOT / project / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["package-dir"] == {"": "."}


def test_the_benchmarks_add_kvcore_bench_through_the_cli_entry_point_group():
    config = tomllib.loads((ROOT / "benchmarks" / "pyproject.toml").read_text())
    assert config["project"]["entry-points"]["kvcore.cli"] == {"bench": "kvcore_bench.cli:add_command"}
    # NOTE: the benchmarks read kvcore internals, so they pin the core's own release.
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert config["project"]["dependencies"] == [f"kvcore=={core}"]
