"""Layout resolution across workers and backends.

Invariant: the chosen layout is supported by every worker, is block-compact
when the layers' pages differ in shape, and is the first common layout in the
first listing worker's order (as vLLM resolves it); LBNHC only when no worker
states a preference.
"""

from __future__ import annotations

import pytest
import torch
from _plugin_dists import clean_plugin_env  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcore
from kvcore.errors import PluginError
from kvcore.memory.layout import KVCacheLayout as KL
from kvcore.plugins.answers import HookAnswers
from kvcore.plugins.layouts import resolve_kv_cache_layout, supported_layouts

FULL = kvcore.FullAttentionSpec(16, 8, 64, torch.bfloat16)
SLIDING = kvcore.SlidingWindowSpec(16, 8, 64, torch.bfloat16, sliding_window=128)
MAMBA = kvcore.MambaSpec(16, [(4, 64)], [torch.float32])


def test_intersection_in_first_workers_order():
    workers = [[KL.BLNHC, KL.LHBNC, KL.LBHNC], [KL.LHBNC, KL.BLNHC]]
    assert resolve_kv_cache_layout(workers) == KL.BLNHC
    assert resolve_kv_cache_layout([["LBHNC", "LBNHC"]]) == KL.LBHNC  # as vLLM: first common preference
    assert resolve_kv_cache_layout([None, ["blnhc", "lbnhc"]]) == KL.BLNHC  # None states no preference
    assert resolve_kv_cache_layout([]) == resolve_kv_cache_layout([None, None]) == KL.LBNHC
    assert resolve_kv_cache_layout([None], [FULL, MAMBA]) == KL.LBNHC
    assert resolve_kv_cache_layout([["HND"]]) == KL.LBHNC


def test_workers_without_common_layout():
    with pytest.raises(ValueError, match=r"worker 0: \[BLNHC\]; worker 1: \[LBNHC, LHBNC\]"):
        resolve_kv_cache_layout([[KL.BLNHC], [KL.LBNHC, KL.LHBNC]])
    with pytest.raises(ValueError, match="unknown KV cache layout 'ZZZ'"):
        resolve_kv_cache_layout([["ZZZ"]])


def test_mixed_pages_narrow_to_block_compact():
    workers = [[KL.LHBNC, KL.BHLNC, KL.BLHNC]]
    assert resolve_kv_cache_layout(workers, [FULL, SLIDING]) == KL.LHBNC  # same shape
    assert resolve_kv_cache_layout(workers, {"a": FULL, "m": MAMBA}) == KL.BLHNC
    with pytest.raises(ValueError, match="need a block-compact layout.*LHBNC, BHLNC"):
        resolve_kv_cache_layout([[KL.LHBNC, KL.BHLNC]], [FULL, MAMBA])
    uniform = kvcore.UniformTypeKVCacheSpecs(16, {"a": FULL, "b": kvcore.FullAttentionSpec(16, 4, 64, torch.bfloat16)})
    assert resolve_kv_cache_layout(workers, [uniform]) == KL.BLHNC


def test_explicit_request_by_argument_and_environment(monkeypatch):
    workers = [[KL.BLNHC, KL.LBNHC]]
    assert resolve_kv_cache_layout(workers, requested="blnhc") == KL.BLNHC
    monkeypatch.setenv("KVCORE_KV_CACHE_LAYOUT", "BLNHC")
    assert resolve_kv_cache_layout(workers) == KL.BLNHC
    assert resolve_kv_cache_layout(workers, requested=KL.LBNHC) == KL.LBNHC  # argument wins
    monkeypatch.setenv("KVCORE_KV_CACHE_LAYOUT", "LHBNC")
    with pytest.raises(ValueError, match=r"LHBNC is not usable here; candidates: \[BLNHC, LBNHC\]"):
        resolve_kv_cache_layout(workers)
    with pytest.raises(ValueError, match=r"BLNHC is not usable.*candidates: \[LBNHC\]"):
        resolve_kv_cache_layout([[KL.LBNHC]], requested="BLNHC")


LAYOUT_LISTS = st.lists(st.sampled_from(list(KL)), min_size=1, max_size=6, unique=True)


@settings(max_examples=60, deadline=None)
@given(workers=st.lists(LAYOUT_LISTS, min_size=1, max_size=4), mixed=st.booleans())
def test_resolution_invariants(workers, mixed):
    specs = [FULL, MAMBA] if mixed else [FULL]
    allowed = [x for x in workers[0] if all(x in w for w in workers) and (x.is_block_compact or not mixed)]
    if not allowed:
        with pytest.raises(ValueError):
            resolve_kv_cache_layout(workers, specs)
        return
    got = resolve_kv_cache_layout(workers, specs)
    assert got in allowed
    assert got == allowed[0]


class Layouts:
    def __init__(self, table):
        self.table = table

    @kvcore.hookimpl
    def kvcore_supported_layouts(self, backend, spec):
        return self.table.get(backend)


def test_layouts_come_from_the_hook():
    b1, b2, b3, bad = (type(f"L{i}", (kvcore.AttentionBackend,), {"name": f"l{i}"}) for i in range(4))
    pm = kvcore.get_plugin_manager(autoload=False)
    pm.register(Layouts({b1: ["BLNHC", KL.LBNHC, KL.LHBNC], b2: [KL.LHBNC, KL.BLNHC], bad: "BLNHC"}),
                name="layouts-plugin")
    assert supported_layouts(b1, FULL, plugin_manager=pm) == [KL.BLNHC, KL.LBNHC, KL.LHBNC]
    assert supported_layouts(b3, plugin_manager=pm) == list(KL)
    common = HookAnswers(pm).common_layouts  # one worker's entry of resolve_kv_cache_layout
    assert common([(b3, None), (b1, None), (b2, None)]) == [KL.BLNHC, KL.LHBNC]
    assert common([(b3, None)]) is None  # no choosy backend: any layout
    assert resolve_kv_cache_layout([common([(b1, None), (b2, None)])]) == KL.BLNHC
    with pytest.raises(PluginError, match="layouts-plugin.*kvcore_supported_layouts"):
        supported_layouts(bad, plugin_manager=pm)
    pm.register(Layouts({b3: [KL.BHLNC]}))
    with pytest.raises(ValueError, match=r"share no KV cache layout: l0: \[BLNHC, LBNHC, LHBNC\]; l2: \[BHLNC\]"):
        HookAnswers(pm).common_layouts([(b1, None), (b3, None)])
