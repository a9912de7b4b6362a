"""Binding caches to layers, layer indices, and KV sharing."""

from __future__ import annotations

import pytest
import torch

from kvcore.memory.config import KVCacheGroupSpec
from kvcore.model_runner.binding import (
    add_kv_sharing_layers_to_kv_cache_groups,
    bind_kv_cache,
    bind_kv_cache_to_layers,
    clear_layer_kv_caches,
    extract_layer_index,
    initialize_kv_cache_for_kv_sharing,
)
from kvcore.specs import FullAttentionSpec

SPEC = FullAttentionSpec(16, num_kv_heads=2, head_size=8, dtype=torch.float16)


class Attn:
    def __init__(self):
        self.kv_cache = torch.tensor([])


class SelfBinding:
    """A layer that installs its cache itself (and records the call)."""

    def __init__(self):
        self.bound = []

    def bind_kv_cache(self, kv_cache):
        self.bound.append(kv_cache)


@pytest.mark.parametrize(
    "name, num, index",
    [
        ("model.layers.3.self_attn", 1, 3),
        ("model.layers.12.mixer", 1, 12),
        ("decoder.layers.7.attn.1", 2, 15),
        ("decoder.layers.7.attn", 2, 7),
        ("layers.7.mlp", 3, 7),
    ],
)
def test_extract_layer_index(name, num, index):
    assert extract_layer_index(name, num) == index


@pytest.mark.parametrize("name, num", [("model.lm_head", 1), ("layers.1.attn.2", 1), ("a.1.attn.2.3", 2)])
def test_extract_layer_index_needs_the_right_integers(name, num):
    with pytest.raises(ValueError, match=repr(name)):
        extract_layer_index(name, num)


def test_extract_layer_index_bad_arguments():
    with pytest.raises(ValueError):
        extract_layer_index("layers.1.attn", 0)
    with pytest.raises(TypeError):
        extract_layer_index(1)


def _caches(names):
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randn(4, 2, generator=gen) for n in names}


def test_bind_kv_cache_orders_by_layer_index_and_binds_each_layer():
    names = ["m.layers.2.attn", "m.layers.0.attn", "m.layers.1.cross_attn", "m.layers.1.self_attn"]
    caches = _caches(names)
    ctx = {n: Attn() for n in names}
    ctx["m.layers.0.attn"] = SelfBinding()
    runner: list[torch.Tensor] = []
    bind_kv_cache(caches, ctx, runner)
    order = ["m.layers.0.attn", "m.layers.1.cross_attn", "m.layers.1.self_attn", "m.layers.2.attn"]
    assert [id(t) for t in runner] == [id(caches[n]) for n in order]
    assert ctx["m.layers.0.attn"].bound == [caches["m.layers.0.attn"]]  # method preferred
    for n in ["m.layers.2.attn", "m.layers.1.cross_attn", "m.layers.1.self_attn"]:
        assert ctx[n].kv_cache is caches[n]


def test_bind_kv_cache_gives_layers_the_kernel_views():
    caches = _caches(["l.0.attn", "l.1.attn"])
    kernel = {n: t.view(8, 1) for n, t in caches.items()}
    ctx = {n: Attn() for n in caches}
    runner: list[torch.Tensor] = []
    bind_kv_cache(caches, ctx, runner, layer_kv_caches=kernel)
    assert all(ctx[n].kv_cache is kernel[n] for n in caches)
    assert [id(t) for t in runner] == [id(caches[n]) for n in caches]


def test_bind_kv_cache_refuses_a_filled_runner_list():
    caches = _caches(["l.0.attn"])
    ctx = {"l.0.attn": Attn()}
    with pytest.raises(ValueError, match="already holds 1 caches"):
        bind_kv_cache(caches, ctx, [torch.zeros(1)])
    assert ctx["l.0.attn"].kv_cache.numel() == 0


def test_binding_checks_every_layer_before_binding_any():
    caches = _caches(["l.0.attn", "l.1.attn", "l.2.attn"])
    ctx = {"l.0.attn": Attn(), "l.1.attn": object(), "l.2.attn": Attn()}
    runner: list[torch.Tensor] = []
    with pytest.raises(TypeError, match="'l.1.attn'.*bind_kv_cache"):
        bind_kv_cache(caches, ctx, runner)
    assert runner == [] and ctx["l.0.attn"].kv_cache.numel() == 0
    with pytest.raises(ValueError, match="not in the forward context"):
        bind_kv_cache_to_layers(caches, {"l.0.attn": Attn()})


def test_binding_checks_groups_when_given():
    caches = _caches(["l.0.attn", "l.1.attn"])
    ctx = {n: Attn() for n in caches}
    groups = [KVCacheGroupSpec(["l.0.attn"], SPEC)]
    with pytest.raises(ValueError, match=r"\['l.1.attn'\].*in no KV cache group"):
        bind_kv_cache_to_layers(caches, ctx, kv_cache_groups=groups)
    groups[0].layer_names.append("l.1.attn")
    bind_kv_cache_to_layers(caches, ctx, kv_cache_groups=groups)
    assert ctx["l.1.attn"].kv_cache is caches["l.1.attn"]


def test_clear_layer_kv_caches():
    ctx = {"a": Attn(), "b": Attn(), "c": SelfBinding()}
    ctx["a"].kv_cache = torch.randn(3)
    ctx["b"].kv_cache = [torch.randn(3), torch.randn(2)]
    clear_layer_kv_caches(ctx)
    assert isinstance(ctx["a"].kv_cache, torch.Tensor) and ctx["a"].kv_cache.numel() == 0
    assert ctx["b"].kv_cache == []
    layer = Attn()
    layer.kv_cache = torch.randn(2)
    clear_layer_kv_caches([layer])
    assert layer.kv_cache.numel() == 0


def _groups():
    return [KVCacheGroupSpec(["l.0", "l.2"], SPEC), KVCacheGroupSpec(["l.1"], SPEC)]


def test_add_kv_sharing_layers():
    groups = _groups()
    runner_only: set[str] = set()
    add_kv_sharing_layers_to_kv_cache_groups({"l.3": "l.1", "l.4": "l.0"}, groups, runner_only)
    assert groups[0].layer_names == ["l.0", "l.2", "l.4"]
    assert groups[1].layer_names == ["l.1", "l.3"]
    assert runner_only == {"l.3", "l.4"}


def test_kv_sharing_refuses_unknown_targets_and_changes_nothing():
    groups = _groups()
    with pytest.raises(ValueError, match="'l.9', which is in no KV cache group"):
        add_kv_sharing_layers_to_kv_cache_groups({"l.3": "l.1", "l.4": "l.9"}, groups)
    assert [g.layer_names for g in groups] == [["l.0", "l.2"], ["l.1"]]
    with pytest.raises(ValueError, match="already in a KV cache group"):
        add_kv_sharing_layers_to_kv_cache_groups({"l.2": "l.0"}, groups)


def test_initialize_kv_cache_for_kv_sharing_points_at_the_target():
    groups = _groups()
    caches = _caches(["l.0", "l.1", "l.2"])
    initialize_kv_cache_for_kv_sharing({"l.3": "l.2"}, groups, caches)
    assert caches["l.3"] is caches["l.2"]
    assert groups[0].layer_names == ["l.0", "l.2", "l.3"]
    with pytest.raises(ValueError, match="'l.7', which is in no KV cache group"):
        initialize_kv_cache_for_kv_sharing({"l.4": "l.7"}, groups, caches)
    del caches["l.1"]
    with pytest.raises(ValueError, match=r"targets \['l.1'\] have no allocated cache"):
        initialize_kv_cache_for_kv_sharing({"l.5": "l.1"}, groups, caches)
    assert "l.5" not in caches and groups[1].layer_names == ["l.1"]
