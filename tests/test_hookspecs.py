"""Every hook is documented, flagged as SPEC §4 says, and has a core default."""

from __future__ import annotations

import inspect

import pluggy
import pytest
import torch
from _plugin_dists import clean_plugin_env  # noqa: F401

import kvcore
from kvcore.plugins import hookspecs
from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.layouts import supported_layouts
from kvcore.specs import MultipleOf

HOOKS = {
    "kvcore_register_backends": False,
    "kvcore_supported_kernel_block_sizes": True,
    "kvcore_supported_layouts": True,
    "kvcore_customize_spec": True,
}


def _specs():
    return {
        name: fn for name, fn in vars(hookspecs).items()
        if name.startswith("kvcore_") and callable(fn)
    }


def test_hook_set_and_firstresult_flags():
    pm = kvcore.get_plugin_manager(autoload=False)
    assert set(_specs()) == set(HOOKS)
    for name, firstresult in HOOKS.items():
        assert getattr(pm.hook, name).spec.opts["firstresult"] is firstresult


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_every_hookspec_is_documented(name):
    fn = _specs()[name]
    doc = inspect.getdoc(fn)
    assert doc, f"{name} has no docstring"
    summary = doc.splitlines()[0]
    assert summary.endswith(".") and len(summary) < 90
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"{name} does not document {param}"
    assert ":returns:" in doc
    assert ("Stops at the first non-None result" in doc) is HOOKS[name]


def test_markers_belong_to_project_kvcore():
    other = pluggy.HookimplMarker("not-kvcore")

    class Mixed:
        @kvcore.hookimpl
        def kvcore_supported_kernel_block_sizes(self, backend, spec):
            return [8]

        @other
        def kvcore_supported_layouts(self, backend, spec):
            return ["BLNHC"]

    pm = kvcore.get_plugin_manager(autoload=False)
    plugin = Mixed()
    pm.register(plugin)
    assert [c.name for c in pm.get_hookcallers(plugin)] == ["kvcore_supported_kernel_block_sizes"]
    assert kvcore.hookspec.project_name == kvcore.hookimpl.project_name == "kvcore"


def test_core_defaults_accept_anything():
    pm = kvcore.get_plugin_manager(autoload=False)
    spec = kvcore.FullAttentionSpec(16, 4, 64, torch.bfloat16)
    backend = type("Plain", (kvcore.AttentionBackend,), {"name": "plain"})
    assert pm.hook.kvcore_supported_kernel_block_sizes(backend=backend, spec=spec) == [MultipleOf(1)]
    assert pm.hook.kvcore_customize_spec(backend=backend, spec=spec) is spec
    assert pm.hook.kvcore_supported_layouts(backend=backend, spec=spec) is None
    assert supported_layouts(backend, spec, plugin_manager=pm) == list(KVCacheLayout)
    assert kvcore.customize_attention_spec(backend, spec, plugin_manager=pm) == spec
