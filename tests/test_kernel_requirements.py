"""KernelRequirements, the requirements and priority hooks, and select_backend ("auto")."""

from __future__ import annotations

import pytest
import torch
from _plugin_dists import clean_plugin_env  # noqa: F401

import kvcore
from kvcore.errors import PluginError, PluginWarning
from kvcore.plugins.auto import preferred_block_size
from kvcore.specs import MultipleOf
from kvcore_torch import TorchAttentionBackend

# NOTE: what "auto" picks depends on the backends installed: only this repository's load.
pytestmark = pytest.mark.usefixtures("own_plugins")

SPEC = kvcore.FullAttentionSpec(16, 2, 32, torch.float16)


def make_backend(name: str) -> type[kvcore.AttentionBackend]:
    """A registrable backend (forward implemented) named ``name``."""
    return type(name.title(), (TorchAttentionBackend,), {"name": name})


class Declares:
    """An in-process plugin owning one backend with fixed answers."""

    def __init__(self, backend, requirements=None, priority=None, sizes=None):
        self.backend, self.req, self.prio, self.sizes = backend, requirements, priority, sizes

    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register(self.backend)

    @kvcore.hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        return self.req if backend is self.backend else None

    @kvcore.hookimpl
    def kvcore_backend_priority(self, backend, spec, device):
        return self.prio if backend is self.backend else None

    @kvcore.hookimpl
    def kvcore_supported_kernel_block_sizes(self, backend, spec):
        return self.sizes if backend is self.backend else None


def manager(*plugins):
    pm = kvcore.get_plugin_manager(autoload=False)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return pm


def test_requirements_are_keyword_only_frozen_and_normalized():
    req = kvcore.KernelRequirements(devices=["cuda"], dtypes=torch.float16, head_sizes=[64, 128],
                                    max_stride_elements=2**31, alignment_bytes=16)
    assert req.devices == ("cuda",) and req.dtypes == (torch.float16,) and req.head_sizes == (64, 128)
    assert kvcore.KernelRequirements() == kvcore.KernelRequirements(alignment_bytes=1)
    assert kvcore.KernelRequirements(devices=(torch.device("cuda"), "cpu")).devices == ("cuda", "cpu")
    with pytest.raises(TypeError):
        kvcore.KernelRequirements(("cuda",))  # keyword-only
    with pytest.raises(AttributeError):
        req.alignment_bytes = 4  # frozen


@pytest.mark.parametrize("kwargs, error, words", [
    ({"devices": ("cuda:0",)}, ValueError, "no index"),
    ({"devices": (torch.device("cuda", 0),)}, TypeError, "device type names"),
    ({"devices": ("banana",)}, ValueError, "'banana'"),
    ({"devices": (1,)}, TypeError, "device type names"),
    ({"devices": ()}, ValueError, "None for any"),
    ({"dtypes": ("float16",)}, TypeError, "torch dtypes"),
    ({"head_sizes": (0,)}, ValueError, "positive"),
    ({"head_sizes": (True,)}, TypeError, "bool"),
    ({"max_stride_elements": -3}, ValueError, "-3"),
    ({"alignment_bytes": 0}, ValueError, "alignment_bytes"),
    ({"alignment_bytes": 2.5}, TypeError, "alignment_bytes"),
])
def test_bad_requirement_fields_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        kvcore.KernelRequirements(**kwargs)


def test_view_rules_name_the_first_broken_rule():
    req = kvcore.KernelRequirements(max_stride_elements=1000, alignment_bytes=16)
    assert req.view_violation([512, 64, 8, 1], 2, 0) is None
    assert req.view_violation([1024, 64, 8, 1], 2, 0)[:2] == ("max_stride_elements", 1024)
    assert req.view_violation([512, 64, 3, 1], 2, 0)[:2] == ("alignment_bytes", 6)
    assert req.view_violation([512, 64, 8, 1], 2, 40)[:2] == ("alignment_bytes", 40)
    # The last stride is never held to the alignment.
    assert kvcore.KernelRequirements(alignment_bytes=8).view_violation([4, 3], 2, 0) is None


def test_select_backend_among_able_backends_by_priority_then_name():
    fast, slow, cpu_only = make_backend("fast"), make_backend("slow"), make_backend("cpuonly")
    pm = manager(
        Declares(fast, kvcore.KernelRequirements(devices=("cuda",), dtypes=(torch.float16,)), 5),
        Declares(slow, None, 5),
        Declares(cpu_only, kvcore.KernelRequirements(devices=("cpu",)), 9),
    )
    # cuda: cpuonly cannot, fast and slow tie at 5 -> first name.
    assert kvcore.select_backend(SPEC, "cuda", plugin_manager=pm) is fast
    assert kvcore.select_backend(SPEC, torch.device("cuda", 1), plugin_manager=pm) is fast
    assert kvcore.select_backend(SPEC, "cpu", plugin_manager=pm) is cpu_only
    # bf16 rules 'fast' out on cuda; the core's torch-free default priority 0 loses to 5.
    bf16 = kvcore.FullAttentionSpec(16, 2, 32, torch.bfloat16)
    assert kvcore.select_backend(bf16, "cuda:0", plugin_manager=pm) is slow


def test_no_backend_can_serve_lists_every_backend_and_why():
    a, b = make_backend("aa"), make_backend("bb")
    pm = manager(
        Declares(a, kvcore.KernelRequirements(devices=("cuda",))),
        Declares(b, kvcore.KernelRequirements(head_sizes=(64, 128))),
    )
    with pytest.raises(ValueError) as info:
        kvcore.select_backend(SPEC, "cpu", plugin_manager=pm)
    text = str(info.value)
    assert "aa: runs on cuda only, not cpu" in text and "bb: takes head sizes [64, 128], not 32" in text
    assert kvcore.select_backend(SPEC, "cuda", plugin_manager=pm) is a
    with pytest.raises(ValueError, match="none is registered"):
        kvcore.select_backend(SPEC, "cpu", plugin_manager=manager())


def test_select_backend_refuses_bad_arguments_and_bad_answers():
    pm = manager(Declares(make_backend("odd"), "cuda", "high"))
    with pytest.raises(ValueError, match="'banana'"):
        kvcore.select_backend(SPEC, "banana", plugin_manager=pm)
    with pytest.raises(TypeError, match="KVCacheSpec"):
        kvcore.select_backend("spec", "cpu", plugin_manager=pm)
    with pytest.raises(PluginError, match="kvcore_kernel_requirements"):
        kvcore.select_backend(SPEC, "cpu", plugin_manager=pm)
    pm = manager(Declares(make_backend("odd"), None, "high"))
    with pytest.raises(PluginError, match="kvcore_backend_priority"):
        kvcore.select_backend(SPEC, "cpu", plugin_manager=pm)


def test_first_party_backends_triton_on_cuda_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("KVCORE_PLUGINS", "torch,triton")  # NOTE: other installed plugins may outbid
    pm = kvcore.get_plugin_manager()
    spec = kvcore.FullAttentionSpec(16, 8, 128, torch.bfloat16)
    assert kvcore.select_backend(spec, "cuda", plugin_manager=pm).name == "triton"
    assert kvcore.select_backend(spec, "cpu", plugin_manager=pm).name == "torch"


def test_triton_runs_on_cuda_only_unless_interpreted(monkeypatch):
    from kvcore_triton import TritonAttentionBackend, _checks
    from kvcore_triton import plugin as triton_plugin

    # NOTE: Triton fixes the interpreter when it decorates the kernels (kvcore_triton's import).
    monkeypatch.setattr(_checks, "INTERPRETED", False)
    monkeypatch.setenv("KVCORE_PLUGINS", "torch,triton")
    req = triton_plugin.kvcore_kernel_requirements(backend=TritonAttentionBackend, spec=SPEC)
    assert req.devices == ("cuda",) and torch.bfloat16 in req.dtypes and 128 in req.head_sizes
    pm = kvcore.get_plugin_manager()
    assert kvcore.select_backend(SPEC, "cpu", plugin_manager=pm).name == "torch"
    assert kvcore.select_backend(SPEC, "cuda", plugin_manager=pm).name == "triton"
    fp8 = kvcore.FullAttentionSpec(16, 2, 32, torch.float8_e4m3fn)
    assert kvcore.select_backend(fp8, "cuda", plugin_manager=pm).name == "torch"  # not a triton dtype
    monkeypatch.setattr(_checks, "INTERPRETED", True)
    assert triton_plugin.kvcore_kernel_requirements(backend=TritonAttentionBackend, spec=SPEC).devices is None


def test_preferred_block_size_is_the_first_explicit_int():
    a, b, c = make_backend("aa"), make_backend("bb"), make_backend("cc")
    pm = manager(Declares(a, sizes=[MultipleOf(8), 64, 16]), Declares(b, sizes=[MultipleOf(16)]), Declares(c))
    assert preferred_block_size(a, SPEC, plugin_manager=pm) == 64
    assert preferred_block_size("bb", SPEC, plugin_manager=pm) is None
    assert preferred_block_size(c, plugin_manager=pm) is None  # core default: any size
    assert preferred_block_size("triton", SPEC, plugin_manager=kvcore.get_plugin_manager()) == 64


def test_kvcore_plugins_shows_requirements_and_what_auto_picks(capsys):
    import json

    from kvcore.cli import main

    main(["plugins", "--json"])
    items = {item["name"]: item for item in json.loads(capsys.readouterr().out)}
    assert items["torch"]["auto"] == {"torch": ["cpu"]}
    assert items["torch"]["requirements"]["torch"]["devices"] is None
    triton = items["triton"]["requirements"]["triton"]
    assert "bfloat16" in triton["dtypes"] and 128 in triton["head_sizes"] and triton["alignment_bytes"] == 1
    main(["plugins"])
    flat = " ".join(capsys.readouterr().out.split())  # NOTE: lines wrap at the terminal's width
    assert "auto picks cpu: torch" in flat and "head sizes 1-256" in flat


@pytest.mark.kvcore_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_cuda_serves_with_triton_and_attends_right(monkeypatch):
    from kvcore import CommonAttentionMetadata

    monkeypatch.setenv("KVCORE_PLUGINS", "torch,triton")

    spec = kvcore.FullAttentionSpec(128, 2, 64, torch.bfloat16)
    kv = kvcore.KVCache.create({"l0": spec}, {"l0": "auto"}, device="cuda", num_blocks=6,
                               max_num_seqs=1, max_model_len=256)
    group = kv.group_of("l0")
    assert group.backend.name == "triton" and kv.kernel_block_sizes == [64]
    (block,) = kv.block_pool.allocate(1)
    kv.begin_step()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(70, h, 64, generator=gen).to("cuda", torch.bfloat16) for h in (4, 2, 2))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 70], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([70], dtype=torch.int32, device="cuda"),
        block_table_tensor=torch.tensor([[block]], dtype=torch.int32, device="cuda"),
        slot_mapping=block * 128 + torch.arange(70, device="cuda"),
        num_reqs=1, num_actual_tokens=70, max_query_len=70, max_seq_len=70,
    )
    out = group.backend.forward(q, k, v, kv.layer_kv_caches["l0"], kv.build_metadata([common])["l0"],
                                head_size=64, scale=0.125)
    qf, kf, vf = (t.float().cpu() for t in (q, k, v))
    scores = torch.einsum("thd,shd->hts", qf, kf.repeat_interleave(2, dim=1)) * 0.125
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, -torch.inf).softmax(-1)
    ref = torch.einsum("hts,shd->thd", weights, vf.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_ambiguous_names_are_never_picked_and_spec_none_skips_dtype_and_head_size():
    solo = make_backend("solo")

    # NOTE: two plugins with hooks of their own: the manager tells plugins apart by their hook code.
    class TwinA:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(make_backend("twin"))

    class TwinB:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(make_backend("twin"))

    pm = manager(TwinA(), TwinB(), Declares(solo, kvcore.KernelRequirements(devices=("cuda",), head_sizes=(128,))))
    with pytest.raises(ValueError) as info:
        kvcore.select_backend(SPEC, "cpu", plugin_manager=pm)
    assert "twin: its name is registered by several plugins" in str(info.value)
    assert "solo: runs on cuda only" in str(info.value)
    # With no spec, only the device is checked: solo's head sizes do not rule it out.
    assert kvcore.select_backend(None, "cuda", plugin_manager=pm) is solo



class _RaisesForEveryBackend:
    """A plugin whose requirements (or priority) hook raises whatever backend it is asked about."""

    def __init__(self, hook):
        self.hook = hook

    @kvcore.hookimpl
    def kvcore_kernel_requirements(self, backend, spec):
        if self.hook == "requirements":
            raise RuntimeError("requirements table missing")

    @kvcore.hookimpl
    def kvcore_backend_priority(self, backend, spec, device):
        if self.hook == "priority":
            raise RuntimeError("priority table missing")


@pytest.mark.parametrize("hook", ["requirements", "priority"])
def test_a_plugin_whose_hook_raises_is_reported_skipped_and_the_others_serve(hook):
    from kvcore.plugins.health import check_plugins
    from kvcore_torch import plugin as torch_plugin

    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(torch_plugin, name="torch")
    pm.register(_RaisesForEveryBackend(hook), name="broken")
    with pytest.warns(PluginWarning, match=f"'broken'.*RuntimeError: {hook} table missing.*kvcore_"):
        assert kvcore.select_backend(SPEC, "cpu", plugin_manager=pm) is TorchAttentionBackend
    with pytest.warns(PluginWarning, match="'broken'"):
        kv = kvcore.KVCache.create({"l0": SPEC, "l1": SPEC}, dict.fromkeys(["l0", "l1"], "auto"), device="cpu",
                                   num_blocks=4, max_num_seqs=1, max_model_len=32, plugin_manager=pm)
    assert {g.backend for g in kv.attn_groups[0]} == {TorchAttentionBackend}
    with pytest.warns(PluginWarning):
        (info,) = [i for i in check_plugins(pm) if i.name == "broken"]
    assert info.status == "unhealthy" and f"{hook} table missing" in info.error
    # A backend whose own plugin fails is skipped by "auto", and refused when named.

    class OwnBroken(Declares):
        @kvcore.hookimpl
        def kvcore_kernel_requirements(self, backend, spec):
            if backend is self.backend:
                raise RuntimeError("own table missing")

    pm = manager(OwnBroken(make_backend("odd"), priority=9))
    pm.register(torch_plugin, name="torch")
    with pytest.warns(PluginWarning, match="'p0'.*own table missing"):
        assert kvcore.select_backend(SPEC, "cpu", plugin_manager=pm) is TorchAttentionBackend
    with pytest.raises(PluginError, match="'p0'.*own table missing.*kvcore_kernel_requirements"):
        kvcore.KVCache.create({"l0": SPEC}, {"l0": "odd"}, device="cpu", num_blocks=4, max_num_seqs=1,
                              max_model_len=32, plugin_manager=pm)
