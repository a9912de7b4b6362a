"""Plugin discovery, environment switches and failure attribution.

Distributions are faked with a dist-info folder on sys.path (no installs);
in-process plugins are registered on a fresh manager and unregistered after.
"""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from _plugin_dists import backend_plugin_source, clean_plugin_env, make_backend, make_dist  # noqa: F401

import kvcore
from kvcore.errors import PluginError, PluginWarning
from kvcore.plugins import (
    default_plugin_manager,
    get_backend,
    get_backends,
    list_plugins,
    reset_default_plugin_manager,
)


@pytest.fixture
def two_dists(tmp_path, monkeypatch):
    """Distributions foo-dist 1.0 (backend foo-attn) and bar-dist 2.3 (backend bar-attn)."""
    make_dist(tmp_path, "foo-dist", "1.0", {"foo": "fakeplug_foo"},
              {"fakeplug_foo": backend_plugin_source("foo-attn", "[32]")})
    make_dist(tmp_path, "bar-dist", "2.3", {"bar": "fakeplug_bar"},
              {"fakeplug_bar": backend_plugin_source("bar-attn", "[16]")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,bar")
    return tmp_path


def test_entry_point_is_discovered_and_loaded(two_dists):
    pm = kvcore.get_plugin_manager()
    info = pm.plugin_infos["foo"]
    assert (info.status, info.distribution, info.version) == ("loaded", "foo-dist", "1.0")
    backend = get_backend("foo-attn", pm)
    assert backend.__module__ == "fakeplug_foo" and issubclass(backend, kvcore.AttentionBackend)
    listed = {i.name: i for i in list_plugins(pm)}
    assert listed["bar"].backends == ["bar-attn"]
    assert listed["foo"].hooks == ["kvcore_register_backends", "kvcore_supported_kernel_block_sizes"]


def test_plugin_changes_block_size_choice_without_touching_kvcore(tmp_path, monkeypatch):
    """The acceptance case: one module, one entry point, kvcore's choice changes."""
    make_dist(tmp_path, "kvcore-tiny", "0.1", {"tiny": "fakeplug_tiny"},
              {"fakeplug_tiny": backend_plugin_source("tiny", "[MultipleOf(64), 48]")})
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = kvcore.FullAttentionSpec(96, 2, 8, torch.float16)
    without = kvcore.get_plugin_manager(autoload=False)
    # Without the plugin the core default accepts any size.
    assert kvcore.select_common_block_size(96, [kvcore.AttentionBackend], plugin_manager=without) == 96
    backend = get_backend("tiny")  # the lazily built default manager found the plugin
    assert kvcore.select_common_block_size(96, [backend], [spec]) == 48
    assert kvcore.select_common_block_size(192, ["tiny"]) == 192
    custom = kvcore.customize_attention_spec(backend, spec)
    assert custom.block_stride_alignment is None  # MultipleOf answers: no fixed sizes
    with pytest.raises(ValueError, match=r"No common block size for 80 \(tiny: "):
        kvcore.select_common_block_size(80, [backend])


def test_autoload_off_imports_nothing(two_dists, monkeypatch):
    pm = kvcore.get_plugin_manager(autoload=False)
    assert {i.status for i in pm.plugin_infos.values()} == {"disabled"}
    assert "fakeplug_foo" not in sys.modules and get_backends(pm) == {}
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert kvcore.get_plugin_manager().plugin_infos["bar"].status == "disabled"
    assert "fakeplug_bar" not in sys.modules


def test_allow_and_block_lists(two_dists, monkeypatch):
    monkeypatch.setenv("KVCORE_PLUGINS", "foo")
    pm = kvcore.get_plugin_manager()
    assert pm.plugin_infos["foo"].status == "loaded"
    assert pm.plugin_infos["bar"].status == "disabled" and "fakeplug_bar" not in sys.modules
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,bar")
    monkeypatch.setenv("KVCORE_BLOCK_PLUGINS", "foo")
    pm = kvcore.get_plugin_manager()
    assert pm.plugin_infos["foo"].status == "blocked"
    assert set(get_backends(pm)) == {"bar-attn"}
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,nosuch")
    monkeypatch.delenv("KVCORE_BLOCK_PLUGINS")
    with pytest.warns(PluginWarning, match="nosuch"):
        kvcore.get_plugin_manager()


def test_environment_is_read_when_the_manager_is_built(two_dists, monkeypatch):
    monkeypatch.setenv("KVCORE_PLUGINS", "foo")
    assert set(get_backends()) == {"foo-attn"}
    monkeypatch.setenv("KVCORE_PLUGINS", "bar")
    assert set(get_backends()) == {"foo-attn"}  # the default manager is kept
    reset_default_plugin_manager()
    assert set(get_backends()) == {"bar-attn"}
    assert default_plugin_manager() is default_plugin_manager()
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "maybe")
    with pytest.raises(ValueError, match="KVCORE_STRICT_PLUGINS='maybe'"):
        kvcore.get_plugin_manager()


@pytest.fixture
def broken_dist(two_dists):
    make_dist(two_dists, "broken-dist", "0.9", {"broken": "fakeplug_broken"},
              {"fakeplug_broken": "import fakeplug_no_such_module\n"})
    return two_dists


def test_import_failure_warns_naming_the_plugin_and_others_load(broken_dist, monkeypatch):
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,bar,broken")
    with pytest.warns(PluginWarning) as record:
        pm = kvcore.get_plugin_manager()
    message = str(record[0].message)
    for part in ("'broken'", "broken = fakeplug_broken", "broken-dist 0.9", "fakeplug_no_such_module", "hooks"):
        assert part in message
    assert pm.plugin_infos["broken"].status == "failed"
    assert "fakeplug_no_such_module" in pm.plugin_infos["broken"].error
    assert set(get_backends(pm)) == {"foo-attn", "bar-attn"}


def test_import_failure_raises_in_strict_mode(broken_dist, monkeypatch):
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,bar,broken")
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"'broken'.*broken-dist 0\.9"):
        kvcore.get_plugin_manager()


def test_entry_point_with_unknown_hook_is_skipped(two_dists, monkeypatch):
    extra = "\n@kvcore.hookimpl\ndef kvcore_frobnicate(backend):\n    return 1\n"
    make_dist(two_dists, "typo-dist", "1.1", {"typo": "fakeplug_typo"},
              {"fakeplug_typo": backend_plugin_source("typo-attn", "[8]", extra)})
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,typo")
    with pytest.warns(PluginWarning, match=r"typo-dist 1\.1.*kvcore_frobnicate") as record:
        pm = kvcore.get_plugin_manager()
    known = str(record[0].message).split("kvcore's hooks are")[1]
    assert "kvcore_supported_layouts" in known and "kvcore_frobnicate" not in known
    assert pm.plugin_infos["typo"].status == "failed" and pm.get_plugin("typo") is None
    assert set(get_backends(pm)) == {"foo-attn"}


def test_unmarked_hook_function_is_reported(two_dists, monkeypatch):
    extra = "\ndef kvcore_supported_layouts(backend, spec):\n    return ['BLNHC']\n"
    make_dist(two_dists, "forgot-dist", "0.2", {"forgot": "fakeplug_forgot"},
              {"fakeplug_forgot": backend_plugin_source("forgot-attn", "[8]", extra)})
    monkeypatch.setenv("KVCORE_PLUGINS", "forgot")
    with pytest.warns(PluginWarning, match=r"forgot-dist 0\.2.*kvcore_supported_layouts.*without @kvcore.hookimpl"):
        pm = kvcore.get_plugin_manager()
    assert pm.plugin_infos["forgot"].status == "loaded"


@pytest.mark.parametrize("copycat_entry_point", ["aaa-copycat", "zzz-copycat"])
def test_duplicate_backend_name_is_ambiguous_in_either_load_order(two_dists, monkeypatch, copycat_entry_point):
    """Entry points load alphabetically: the copycat loads before or after bar; neither wins."""
    make_dist(two_dists, "copycat-dist", "3.0", {copycat_entry_point: "fakeplug_copycat"},
              {"fakeplug_copycat": backend_plugin_source("bar-attn", "[8]")})
    monkeypatch.setenv("KVCORE_PLUGINS", f"foo,bar,{copycat_entry_point}")
    either = "'bar-attn' is registered by .*bar-dist.*copycat-dist|'bar-attn' is registered by .*copycat-dist.*bar-dist"
    with pytest.warns(PluginWarning, match=either):
        pm = kvcore.get_plugin_manager()
    with pytest.raises(PluginError) as exc:
        get_backend("bar-attn", pm)
    message = str(exc.value)
    for part in ("'bar-attn'", "bar = fakeplug_bar", "bar-dist 2.3", f"{copycat_entry_point} = fakeplug_copycat",
                 "copycat-dist 3.0", "KVCORE_BLOCK_PLUGINS"):
        assert part in message
    assert set(get_backends(pm)) == {"foo-attn"}  # the other plugin keeps working
    listed = {i.name: i for i in list_plugins(pm)}
    for name, other in (("bar", "copycat-dist"), (copycat_entry_point, "bar-dist")):
        assert listed[name].status == "conflict" and listed[name].backends == ["bar-attn"]
        assert other in listed[name].error
    assert listed["foo"].status == "loaded"
    monkeypatch.setenv("KVCORE_BLOCK_PLUGINS", copycat_entry_point)
    assert get_backend("bar-attn", kvcore.get_plugin_manager()).__module__ == "fakeplug_bar"


def test_hook_failure_in_entry_point_names_distribution_and_hook(two_dists, monkeypatch):
    extra = "\n@kvcore.hookimpl\ndef kvcore_supported_layouts(backend, spec):\n    raise KeyError('zap')\n"
    make_dist(two_dists, "flaky-dist", "4.2", {"flaky": "fakeplug_flaky"},
              {"fakeplug_flaky": backend_plugin_source("flaky-attn", "[8]", extra)})
    monkeypatch.setenv("KVCORE_PLUGINS", "flaky")
    from kvcore.plugins.layouts import supported_layouts

    with pytest.raises(PluginError) as exc:
        supported_layouts("flaky-attn")
    for part in ("'flaky'", "flaky = fakeplug_flaky", "flaky-dist 4.2", "kvcore_supported_layouts", "zap"):
        assert part in str(exc.value)


_Named = make_backend("shared-name")


class _RegistersNamed:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(_Named)


class _AlsoRegistersNamed:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(make_backend("shared-name"))


@pytest.mark.parametrize("first_is_original", [True, False])
def test_in_process_duplicate_names_are_ambiguous_naming_both(first_is_original):
    pm = kvcore.get_plugin_manager(autoload=False)
    plugins = [(_RegistersNamed(), "original"), (_AlsoRegistersNamed(), "copycat")]
    for plugin, name in plugins if first_is_original else plugins[::-1]:
        pm.register(plugin, name=name)
    match = "'shared-name' is registered by .*(original|copycat).* and by .*(copycat|original)"
    with pytest.raises(PluginError, match=match):
        get_backend("shared-name", pm)
    statuses = {i.name: i.status for i in list_plugins(pm)}
    assert statuses["original"] == statuses["copycat"] == "conflict"
    pm.unregister(name="copycat")
    assert get_backend("shared-name", pm) is _Named
    pm.unregister(name="original")
    with pytest.raises(ValueError, match=r"Unknown attention backend 'shared-name'. Registered: \[\]"):
        get_backend("shared-name", pm)


_NO_FORWARD = type("NoForward", (kvcore.AttentionBackend,), {"name": "no-forward"})


@pytest.mark.parametrize(
    "registered, problem",
    [(int, "not a kvcore.AttentionBackend subclass"),
     (type("Nameless", (kvcore.AttentionBackend,), {"forward": _Named.__dict__["forward"]}),
      "without a non-empty str class attribute 'name'"),
     (make_backend(""), "without a non-empty str class attribute 'name'"),
     (_NO_FORWARD, "does not implement forward")],
)
def test_register_checks_the_backend_protocol(registered, problem):
    class Bad:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(registered)

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(Bad(), name="bad-plugin")
    with pytest.raises(PluginError, match=f"bad-plugin.*{problem}.*kvcore_register_backends"):
        get_backends(pm)


def test_backend_without_forward_fails_its_plugin_only(two_dists, monkeypatch):
    source = backend_plugin_source("lazy-attn").replace('    forward = TorchAttentionBackend.__dict__["forward"]\n', "")
    make_dist(two_dists, "lazy-dist", "0.3", {"lazy": "fakeplug_lazy"}, {"fakeplug_lazy": source})
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,lazy")
    with pytest.warns(PluginWarning, match=r"'lazy'.*lazy-dist 0\.3.*does not implement forward"):
        pm = kvcore.get_plugin_manager()
    assert pm.plugin_infos["lazy"].status == "failed" and pm.get_plugin("lazy") is None
    assert set(get_backends(pm)) == {"foo-attn"}
    monkeypatch.setenv("KVCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="lazy-dist 0.3.*does not implement forward"):
        kvcore.get_plugin_manager()
    with pytest.raises(NotImplementedError, match="protocol"):
        kvcore.AttentionBackend.forward(None, None, None, None, None, head_size=1, scale=1.0)


class _Raises:
    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        raise RuntimeError("kernel table missing")


class _WrongType:
    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return "64"


@pytest.mark.parametrize("plugin, problem", [(_Raises, "RuntimeError: kernel table missing"),
                                             (_WrongType, "wrong value")])
def test_hook_raising_or_wrong_type_names_the_plugin(plugin, problem):
    pm = kvcore.get_plugin_manager(autoload=False)
    obj = plugin()
    pm.register(obj, name="culprit")
    with pytest.raises(PluginError, match=f"culprit.*{problem}.*kvcore_supported_kernel_block_sizes"):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)
    pm.unregister(obj)
    assert kvcore.select_common_block_size(64, [_Named], plugin_manager=pm) == 64


def test_tryfirst_and_trylast_order_is_kept():
    order = []

    class Early:
        @kvcore.hookimpl(tryfirst=True)
        def kvcore_supported_kernel_block_sizes(self, backend, spec):
            order.append("early")

    class Normal:
        @kvcore.hookimpl
        def kvcore_supported_kernel_block_sizes(self, backend, spec):
            order.append("normal")
            return [16]

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(Early())
    pm.register(Normal())
    assert kvcore.select_common_block_size(64, [_Named], plugin_manager=pm) == 16
    assert order == ["early", "normal"]


def test_tracing_logs_hook_calls(monkeypatch, caplog):
    monkeypatch.setenv("KVCORE_TRACE_PLUGINS", "1")
    pm = kvcore.get_plugin_manager(autoload=False)
    with caplog.at_level(logging.DEBUG, logger="kvcore.plugins"):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)
        pm.hook.kvcore_supported_layouts(backend=_Named, spec=None)
    text = caplog.text
    assert "kvcore_supported_kernel_block_sizes" in text and "kvcore-core" in text
    assert "kvcore_supported_layouts" in text
    caplog.clear()
    monkeypatch.delenv("KVCORE_TRACE_PLUGINS")
    with caplog.at_level(logging.DEBUG, logger="kvcore.plugins"):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=kvcore.get_plugin_manager(autoload=False))
    assert "kvcore_supported_kernel_block_sizes" not in caplog.text


def test_plugin_manager_argument_is_checked():
    with pytest.raises(TypeError, match="plugin_manager must be a pluggy.PluginManager"):
        get_backends("not a manager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kvcore.get_plugin_manager(autoload=False).get_plugin("kvcore-core") is not None


class _Sizes16:
    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return [16, 32] if backend is _Named else None


class _HalvingWrapper:
    """A new-style wrapper: keeps only the smallest size another plugin offered."""

    @kvcore.hookimpl(wrapper=True)
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        sizes = yield
        return None if sizes is None else [min(sizes)]


class _RecordingOldWrapper:
    def __init__(self):
        self.seen = []

    @kvcore.hookimpl(hookwrapper=True)
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        outcome = yield
        if outcome.exception is None:
            self.seen.append(outcome.get_result())


def test_hook_wrappers_are_honoured():
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(_Sizes16(), name="sizes")
    assert kvcore.select_common_block_size(64, [_Named], plugin_manager=pm) == 32
    recorder = _RecordingOldWrapper()
    pm.register(recorder, name="recorder")
    pm.register(_HalvingWrapper(), name="halving")
    assert kvcore.select_common_block_size(64, [_Named], plugin_manager=pm) == 16
    assert recorder.seen and all(seen in ([16], [16, 32]) for seen in recorder.seen)


class _Explodes:
    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        raise ZeroDivisionError("bad table")


class _BreaksAnswers:
    @kvcore.hookimpl(wrapper=True)
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        yield
        return "16, 32"


def test_errors_under_wrappers_name_the_plugin_at_fault():
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(_RecordingOldWrapper(), name="innocent-wrapper")
    pm.register(_Explodes(), name="exploder")
    match = "exploder.*ZeroDivisionError: bad table.*kvcore_supported_kernel_block_sizes"
    with pytest.raises(PluginError, match=match):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)
    pm.unregister(name="exploder")
    pm.register(_BreaksAnswers(), name="breaker")
    match = r"wrong value.*16, 32.*wrappers of plugins \['breaker', 'innocent-wrapper'\]"
    with pytest.raises(PluginError, match=match):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)
    pm.unregister(name="innocent-wrapper")
    with pytest.raises(PluginError, match="'breaker'.*wrong value.*16, 32"):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)


def test_three_plugins_with_one_name_are_told_to_block_all_but_one(two_dists, monkeypatch):
    """With three owners of a name, blocking one still conflicts: the remedy names the other two."""
    for entry_point in ("copy1", "copy2"):
        make_dist(two_dists, f"{entry_point}-dist", "1.0", {entry_point: f"fakeplug_{entry_point}"},
                  {f"fakeplug_{entry_point}": backend_plugin_source("bar-attn", "[8]")})
    monkeypatch.setenv("KVCORE_PLUGINS", "foo,bar,copy1,copy2")
    with pytest.warns(PluginWarning):
        pm = kvcore.get_plugin_manager()
    with pytest.raises(PluginError) as exc:
        get_backend("bar-attn", pm)
    blocked = str(exc.value).split("KVCORE_BLOCK_PLUGINS=")[1].split(" ")[0].split(",")
    assert len(blocked) == 2 and set(blocked) < {"bar", "copy1", "copy2"}
    monkeypatch.setenv("KVCORE_BLOCK_PLUGINS", ",".join(blocked))
    kept = ({"bar", "copy1", "copy2"} - set(blocked)).pop()
    assert get_backend("bar-attn", kvcore.get_plugin_manager()).__module__ == f"fakeplug_{kept}"


def test_each_backend_is_credited_to_its_plugin_under_a_register_wrapper():
    """Every kvcore_register_backends runs through pluggy (wrappers included) with a register bound to its plugin."""
    wrapped = []

    class Wrapper:
        @kvcore.hookimpl(wrapper=True)
        def kvcore_register_backends(self, register):
            wrapped.append(register)
            return (yield)

    other = make_backend("other-name")

    class RegistersOther:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(other)

    pm = kvcore.get_plugin_manager(autoload=False)
    for plugin, name in ((_RegistersNamed(), "named"), (RegistersOther(), "other"), (Wrapper(), "wrapper")):
        pm.register(plugin, name=name)
    assert get_backends(pm) == {"shared-name": _Named, "other-name": other}
    assert len(wrapped) == 2  # the wrapper saw each plugin's call
    listed = {i.name: i.backends for i in list_plugins(pm)}
    assert (listed["named"], listed["other"], listed["wrapper"]) == (["shared-name"], ["other-name"], [])


def test_a_register_kept_for_later_is_refused():
    kept = []

    class Keeps:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            kept.append(register)

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(Keeps(), name="keeper")
    assert get_backends(pm) == {}
    with pytest.raises(PluginError, match="after kvcore_register_backends returned"):
        kept[0](_Named)
    assert get_backends(pm) == {}


def test_blocked_entry_points_go_through_pluggy(two_dists, monkeypatch):
    monkeypatch.setenv("KVCORE_BLOCK_PLUGINS", "bar")
    pm = kvcore.get_plugin_manager()
    assert pm.is_blocked("bar") and pm.get_plugin("bar") is None and "fakeplug_bar" not in sys.modules
    assert [dist.project_name for _, dist in pm.list_plugin_distinfo()] == ["foo-dist"]


class _Twin:
    """One plugin class registered twice: both instances share their hook code."""

    def __init__(self, backend, answer=None, fails=False):
        self.backend, self.answer, self.fails, self.calls = backend, answer, fails, 0

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(self.backend)

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        self.calls += 1
        if self.fails:
            raise RuntimeError(f"table of {self.backend.name} missing")
        return self.answer


def test_two_instances_of_one_plugin_class_are_told_apart():
    """Each instance is named by its own registration, never by the code the two share."""
    shared = make_backend("twin-attn")
    pm = kvcore.get_plugin_manager(autoload=False)
    first, second = _Twin(shared), _Twin(shared)
    pm.register(first, name="twin-one")
    pm.register(second, name="twin-two")
    with pytest.raises(PluginError, match="'twin-attn' is registered by .*twin-(one|two).* and by .*twin-(two|one)"):
        get_backend("twin-attn", pm)
    listed = {i.name: (i.status, i.backends) for i in list_plugins(pm)}
    assert listed["twin-one"] == listed["twin-two"] == ("conflict", ["twin-attn"])
    pm.unregister(second)
    assert get_backend("twin-attn", pm) is shared
    # pluggy asks the later registration first: "twin-one" answers None, then the earlier one raises.
    pm.unregister(first)
    pm.register(_Twin(make_backend("loud-attn"), fails=True), name="twin-loud")
    pm.register(first, name="twin-one")
    with pytest.raises(PluginError, match=r"'twin-loud'\).*RuntimeError: table of loud-attn missing"):
        kvcore.select_common_block_size(64, [shared], plugin_manager=pm)
    assert first.calls == 1


@pytest.mark.parametrize("wrong_is_later", [True, False])
def test_a_wrong_answer_is_named_without_asking_any_plugin_again(wrong_is_later):
    pm = kvcore.get_plugin_manager(autoload=False)
    quiet, wrong = _Twin(make_backend("quiet-attn")), _Twin(make_backend("wrong-attn"), answer="64")
    order = ((quiet, "quiet"), (wrong, "wrong")) if wrong_is_later else ((wrong, "wrong"), (quiet, "quiet"))
    for plugin, name in order:
        pm.register(plugin, name=name)
    with pytest.raises(PluginError, match=r"'wrong'\).*wrong value.*kvcore_supported_kernel_block_sizes"):
        kvcore.select_common_block_size(64, [_Named], plugin_manager=pm)
    assert wrong.calls == 1  # asked once, by pluggy; the error path calls no plugin
    assert quiet.calls == (0 if wrong_is_later else 1)  # asked before "wrong" only when registered later


def test_a_plugin_registered_in_process_is_described_as_such():
    from kvcore.plugins.manager import PluginInfo

    assert PluginInfo(name="myplug").describe() == "plugin 'myplug' (registered in-process)"
    info = PluginInfo(name="torch", distribution="kvcore-torch", version="0.1.0",
                      entry_point="kvcore_torch.plugin")
    assert info.describe() == (
        "plugin 'torch' (entry point 'kvcore_torch.plugin' of distribution kvcore-torch 0.1.0)")
