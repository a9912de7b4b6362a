"""The ``torch`` entry point registers its backend and answers only for it."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins import get_plugin_manager
from kvcore.plugins.block_sizes import select_common_block_size
from kvcore.plugins.registry import get_backend
from kvcore.specs import FullAttentionSpec, MultipleOf
from kvcore_torch import TorchAttentionBackend
from kvcore_torch import plugin as torch_plugin

SPEC = FullAttentionSpec(48, 2, 64, torch.bfloat16)


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcore.plugins")}
    assert eps.get("torch") == "kvcore_torch.plugin"


def test_manager_loads_the_backend(pm):
    assert get_backend("torch", plugin_manager=pm) is TorchAttentionBackend
    assert pm.plugin_infos["torch"].status == "loaded"


def test_any_block_size_and_layout(pm):
    sizes = pm.hook.kvcore_supported_kernel_block_sizes(backend=TorchAttentionBackend, spec=SPEC)
    assert sizes == [MultipleOf(1)]
    for size in (1, 7, 48, 1024):
        assert select_common_block_size(size, [TorchAttentionBackend], [SPEC], plugin_manager=pm) == size
    layouts = pm.hook.kvcore_supported_layouts(backend=TorchAttentionBackend, spec=SPEC)
    assert layouts[:2] == [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC]
    assert sorted(layouts, key=lambda x: x.name) == sorted(KVCacheLayout, key=lambda x: x.name)


def test_other_backends_get_no_answer():
    class Other(TorchAttentionBackend):
        name = "other"

    assert torch_plugin.kvcore_supported_kernel_block_sizes(backend=Other, spec=SPEC) is None
    assert torch_plugin.kvcore_supported_layouts(backend=Other, spec=SPEC) is None
