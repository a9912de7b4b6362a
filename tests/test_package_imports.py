"""``import kvcore`` is light: public names load on first use, torch only when needed."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvcore


def _modules_after(code: str) -> set[str]:
    """Modules loaded by a fresh interpreter after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_import_kvcore_does_not_import_torch():
    loaded = _modules_after("import kvcore; kvcore.__version__")
    assert "torch" not in loaded and "kvcore" in loaded


def test_a_public_name_imports_its_module():
    loaded = _modules_after("from kvcore import KVCacheLayout")
    assert "kvcore.memory.layout" in loaded and "kvcore.runtime.kv_cache" not in loaded


@pytest.mark.parametrize("name", kvcore.__all__)
def test_every_public_name_is_the_defining_modules_object(name):
    value = getattr(kvcore, name)
    origin = kvcore._ORIGIN.get(name)
    if origin is not None:
        assert value is getattr(importlib.import_module(origin), name)
    elif name != "__version__":
        assert value is importlib.import_module(f"kvcore.{name}")
    assert name in dir(kvcore)


def test_star_import_binds_every_public_name():
    namespace: dict = {}
    exec("from kvcore import *", namespace)
    assert set(kvcore.__all__) <= set(namespace)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        kvcore.NoSuchThing  # noqa: B018
    with pytest.raises(ImportError):
        exec("from kvcore import no_such_module", {})
