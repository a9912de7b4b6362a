"""The ``flashinfer`` plugin on a machine without FlashInfer or a GPU: loads, declares, refuses."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

import kvcore
from kvcore.errors import KVCoreError
from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.plugins.registry import get_backend
from kvcore.specs import FullAttentionSpec, MultipleOf
from kvcore.testing import build_cache
from kvcore_flashinfer import FlashInferAttentionBackend, FlashInferMetadataBuilder
from kvcore_flashinfer import plugin as fi_plugin

SPEC = FullAttentionSpec(16, 2, 64, torch.bfloat16)


@pytest.fixture
def pm(own_plugins):
    """This repository's plugins only: which backend "auto" picks depends on those installed."""
    return own_plugins


def test_entry_point_loads_without_importing_flashinfer(pm):
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcore.plugins")}
    assert eps.get("flashinfer") == "kvcore_flashinfer.plugin"
    assert get_backend("flashinfer", plugin_manager=pm) is FlashInferAttentionBackend
    assert pm.plugin_infos["flashinfer"].status == "loaded"
    if not torch.cuda.is_available():
        assert "flashinfer" not in sys.modules


def test_declares_what_flashinfer_takes(pm):
    hook = pm.hook
    req = hook.kvcore_kernel_requirements(backend=FlashInferAttentionBackend, spec=SPEC)
    assert req.devices == ("cuda",) and set(req.dtypes) == {torch.float16, torch.bfloat16}
    assert {64, 128, 256} <= set(req.head_sizes) and req.max_stride_elements == 2**32
    assert hook.kvcore_supported_kernel_block_sizes(backend=FlashInferAttentionBackend, spec=SPEC) == [MultipleOf(1)]
    layouts = hook.kvcore_supported_layouts(backend=FlashInferAttentionBackend, spec=SPEC)
    assert layouts[0] == KVCacheLayout.LBNHC and set(layouts) == set(KVCacheLayout)
    assert req.why_not("cpu", torch.bfloat16, 64) and req.why_not("cuda", torch.float32, 64)
    assert req.why_not("cuda", torch.bfloat16, 96) and req.why_not("cuda", torch.bfloat16, 128) is None
    # A 2**32-element stride is refused, one below it is not.
    assert req.view_violation([2**32, 128, 1], 2, 0)[0] == "max_stride_elements"
    assert req.view_violation([2**32 - 128, 128, 1], 2, 0) is None


def test_priority_below_triton_and_auto_never_picks_it_on_cpu(pm):
    hook = pm.hook
    cuda = torch.device("cuda")
    ours = hook.kvcore_backend_priority(backend=FlashInferAttentionBackend, spec=SPEC, device=cuda)
    triton = hook.kvcore_backend_priority(backend=get_backend("triton", plugin_manager=pm), spec=SPEC, device=cuda)
    assert ours < triton
    assert kvcore.select_backend(SPEC, "cpu", plugin_manager=pm).name == "torch"


def test_other_backends_get_no_answer():
    class Other(FlashInferAttentionBackend):
        name = "other"

    assert fi_plugin.kvcore_kernel_requirements(backend=Other, spec=SPEC) is None
    assert fi_plugin.kvcore_supported_layouts(backend=Other, spec=SPEC) is None
    assert fi_plugin.kvcore_backend_priority(backend=Other, spec=SPEC, device=torch.device("cuda")) is None


def _metadata(view):
    ints = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    common = CommonAttentionMetadata(
        query_start_loc=ints([0, 1]), seq_lens=ints([3]), block_table_tensor=ints([[1]]),
        slot_mapping=torch.tensor([18]), num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=3,
    )
    builder = FlashInferMetadataBuilder(SPEC, ["l0"], "cpu", max_num_seqs=2, max_model_len=64)
    return builder.build(0, common)


def test_forward_on_cpu_raises_with_remedy_and_writes_nothing():
    view, _ = build_cache("LBNHC", 16, 4, 2, 64, torch.bfloat16, device="cpu")
    metadata = _metadata(view)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    with pytest.raises(KVCoreError, match="CUDA devices only.*'torch' backend"):
        FlashInferAttentionBackend.forward(q, k, v, view, metadata, head_size=64, scale=0.125)
    assert torch.count_nonzero(view) == 0


def test_forward_without_flashinfer_names_the_install(monkeypatch):
    from kvcore_flashinfer import _runtime

    _runtime.flashinfer.cache_clear()
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    try:
        with pytest.raises(KVCoreError, match=r"pip install kvcore-flashinfer\[kernels\]"):
            _runtime.flashinfer()
    finally:
        _runtime.flashinfer.cache_clear()


def test_forward_refuses_foreign_metadata():
    view, _ = build_cache("LBNHC", 16, 4, 2, 64, torch.bfloat16, device="cpu")
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="metadata its builder builds"):
        FlashInferAttentionBackend.forward(q, q[:, :2], q[:, :2], view, object(), head_size=64, scale=0.1)


def test_kvcache_create_refuses_flashinfer_on_cpu_before_allocating(pm):
    from kvcore.errors import KernelRequirementError

    with pytest.raises(KernelRequirementError, match="flashinfer.*devices"):
        kvcore.KVCache.create({"l0": SPEC}, {"l0": "flashinfer"}, device="cpu", num_blocks=8,
                              max_num_seqs=2, max_model_len=64, plugin_manager=pm)

