"""Every hook is documented, flagged first-result where it stops at the first answer, and has a core default."""

from __future__ import annotations

import inspect

import pluggy
import torch
from _plugin_dists import clean_plugin_env  # noqa: F401

import kvcore
from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins import hookspecs
from kvcore.plugins.layouts import supported_layouts
from kvcore.specs import MultipleOf

FIRST_RESULT_ANSWERS = {
    "kvcore_supported_kernel_block_sizes": ([16], [32]),
    "kvcore_supported_layouts": (["LBHNC"], ["BLNHC"]),
    "kvcore_customize_spec": ("first", "second"),
    "kvcore_kernel_requirements": ("first", "second"),
    "kvcore_backend_priority": (3, 7),
}


def _hook_names(pm):
    return sorted(name for name in dir(pm.hook) if name.startswith("kvcore_"))


def test_first_result_hooks_stop_at_the_first_answer_and_say_so():
    """What each hookspec's docstring promises ("Stops at the first non-None result") is what runs."""
    pm = kvcore.get_plugin_manager(autoload=False)
    backend = type("Plain", (kvcore.AttentionBackend,), {"name": "plain"})
    spec = kvcore.FullAttentionSpec(16, 4, 64, torch.bfloat16)
    calls = []
    for hook, (early, late) in FIRST_RESULT_ANSWERS.items():
        first, second = type("First", (), {}), type("Second", (), {})

        def impl(answer, label, _hook=hook):
            def answer_fn(self, backend, spec):
                calls.append((_hook, label))
                return answer

            def answer_dev(self, backend, spec, device):
                return answer_fn(self, backend, spec)
            fn = answer_dev if _hook == "kvcore_backend_priority" else answer_fn
            return kvcore.hookimpl(tryfirst=label == "early")(fn)

        setattr(first, hook, impl(early, "early"))
        setattr(second, hook, impl(late, "late"))
        pm.register(second())
        pm.register(first())
        extra = {"device": torch.device("cpu")} if hook == "kvcore_backend_priority" else {}
        assert getattr(pm.hook, hook)(backend=backend, spec=spec, **extra) == early
        assert (hook, "late") not in calls
        assert "Stops at the first non-None result" in inspect.getdoc(getattr(hookspecs, hook))
    assert set(FIRST_RESULT_ANSWERS) | {"kvcore_register_backends"} == set(_hook_names(pm))


def test_register_backends_asks_every_plugin():
    pm = kvcore.get_plugin_manager(autoload=False)
    seen = []
    for label in ("one", "two"):
        plugin = type(label, (), {"kvcore_register_backends": kvcore.hookimpl(
            lambda self, register, _label=label: seen.append(_label))})
        pm.register(plugin(), name=label)
    assert pm.hook.kvcore_register_backends(register=lambda backend: None) == []  # None answers dropped
    assert sorted(seen) == ["one", "two"]


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
    assert pm.hook.kvcore_kernel_requirements(backend=backend, spec=spec) == kvcore.KernelRequirements()
    assert pm.hook.kvcore_backend_priority(backend=backend, spec=spec, device=torch.device("cpu")) == 0
    assert supported_layouts(backend, spec, plugin_manager=pm) == list(KVCacheLayout)
    assert kvcore.customize_attention_spec(backend, spec, plugin_manager=pm) == spec
