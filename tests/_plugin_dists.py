"""Test helpers: fake installed plugin distributions and a clean plugin environment.

``make_dist`` writes ``<name>-<version>.dist-info`` (METADATA and
entry_points.txt) plus the plugin modules into a directory that the test puts
on ``sys.path``: importlib.metadata then finds the plugin exactly as if it
were pip-installed, with no install step.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kvcore.plugins import reset_default_plugin_manager
from kvcore.plugins.backend import AttentionBackend
from kvcore_torch import TorchAttentionBackend

ENV_VARS = (
    "KVCORE_DISABLE_PLUGIN_AUTOLOAD",
    "KVCORE_PLUGINS",
    "KVCORE_BLOCK_PLUGINS",
    "KVCORE_STRICT_PLUGINS",
    "KVCORE_TRACE_PLUGINS",
    "KVCORE_KV_CACHE_LAYOUT",
)


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch):
    """No KVCORE_* switches, no default manager, no leftover fake plugin modules."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    before = set(sys.modules)
    reset_default_plugin_manager()
    yield
    reset_default_plugin_manager()
    for name in set(sys.modules) - before:
        if name.startswith("fakeplug_"):
            del sys.modules[name]


def make_dist(
    root: Path,
    dist: str,
    version: str,
    entry_points: dict[str, str],
    modules: dict[str, str],
    group: str = "kvcore.plugins",
) -> Path:
    """Write a fake distribution under ``root``; ``modules`` maps module name -> source;
    ``entry_points`` go into ``group``."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n" + lines)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def make_backend(name: str, **attributes: object) -> type[AttentionBackend]:
    """A backend class named ``name`` whose ``forward`` is the torch reference."""
    namespace = {"name": name, "forward": TorchAttentionBackend.__dict__["forward"], **attributes}
    return type(f"B_{name}", (AttentionBackend,), namespace)


def backend_plugin_source(backend_name: str, sizes: str = "None", extra: str = "") -> str:
    """Source of a one-module plugin that registers ``backend_name`` and declares ``sizes``."""
    return f'''
import kvcore
from kvcore.specs import MultipleOf
from kvcore_torch import TorchAttentionBackend


class Backend(kvcore.AttentionBackend):
    name = {backend_name!r}
    forward = TorchAttentionBackend.__dict__["forward"]


@kvcore.hookimpl
def kvcore_register_backends(register):
    register(Backend)


@kvcore.hookimpl
def kvcore_supported_kernel_block_sizes(backend, spec):
    return {sizes} if backend is Backend else None
{extra}'''
