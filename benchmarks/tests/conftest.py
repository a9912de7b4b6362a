"""The benchmark tests run ``kvcore bench``, which needs this distribution installed (its entry
point in group ``kvcore.cli``): without it they are left out, and the header says so."""

from importlib import metadata

INSTALLED = any(e.name == "bench" for e in metadata.entry_points(group="kvcore.cli"))
if not INSTALLED:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if not INSTALLED:
        return "kvcore-bench is not installed: benchmarks/tests left out (pip install -e benchmarks)"
    return None
