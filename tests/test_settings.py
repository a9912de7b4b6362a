"""kvcore.settings: the environment switches, parsed strictly in one place and read where a call begins."""

from __future__ import annotations

import pytest
import torch

from kvcore.plugins.paged_inputs import value_checks
from kvcore.settings import Settings, env_flag, env_names


@pytest.mark.parametrize("raw, parsed", [("1", True), (" TRUE ", True), ("yes", True), ("0", False), ("false", False),
                                         ("off", False), ("", None)])
def test_switches_parse_the_accepted_spellings(raw, parsed):
    assert env_flag("KVCORE_DEBUG_CHECKS", {"KVCORE_DEBUG_CHECKS": raw}) is parsed
    assert Settings.from_env({"KVCORE_DEBUG_CHECKS": raw}).debug_checks is parsed


@pytest.mark.parametrize("raw", ["abc", "2", "enabled", "-1"])
def test_a_bad_switch_names_the_variable_and_the_accepted_values(raw):
    with pytest.raises(ValueError, match=f"KVCORE_DEBUG_CHECKS='{raw}'.*0/1/true/false"):
        Settings.from_env({"KVCORE_DEBUG_CHECKS": raw})


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("0", False), ("", False), ("nonsense", False)])
def test_triton_interpret_is_read_as_triton_reads_it(raw, on):
    assert Settings.from_env({"TRITON_INTERPRET": raw}).triton_interpret is on
    assert Settings.from_env({}) == Settings(debug_checks=None, triton_interpret=False)


def test_names_lists_drop_blanks():
    assert env_names("KVCORE_PLUGINS", {"KVCORE_PLUGINS": " a, ,b ,"}) == {"a", "b"}
    assert env_names("KVCORE_PLUGINS", {"KVCORE_PLUGINS": " "}) is None


def test_value_checks_take_the_callers_settings_and_else_the_environment_now(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "1")
    assert value_checks(None, meta, Settings(debug_checks=False)) is False  # passed down: the environment is not read
    assert value_checks(None, meta) is True
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "0")
    assert value_checks(None, cpu) is False  # a changed environment takes effect at the next call
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "abc")
    with pytest.raises(ValueError, match="KVCORE_DEBUG_CHECKS"):
        value_checks(None, cpu)
    assert value_checks(True, cpu) is True  # an explicit argument wins without reading the environment


#: Tokens per block (the Triton kernels take 16, 32 or 64).
BS = 16


def _one_step(kv, layer: str, slot: int, seed: int):
    """One decode token of one request (blocks 1 and 2) written at ``slot``: random query, key and value."""
    from kvcore.plugins.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([5], dtype=torch.int32),
        block_table_tensor=torch.tensor([[1, 2]], dtype=torch.int32), slot_mapping=torch.tensor([slot]),
        num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=5,
    )
    metadata = kv.build_metadata([common])[layer]
    q, k, v = (torch.randn(1, 2, 8, generator=gen) for _ in range(3))
    return metadata, q, k, v


def _cache(backend: str):
    import kvcore

    spec = kvcore.FullAttentionSpec(BS, 2, 8, torch.float32)
    return kvcore.KVCache.create({"l0": spec}, {"l0": backend}, device="cpu", num_blocks=4, max_num_seqs=2,
                                 max_model_len=2 * BS)


def test_debug_checks_are_read_at_kvcache_create_and_a_changed_environment_takes_effect_at_the_next(monkeypatch):
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "0")
    quiet = _cache("torch")
    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "1")
    checked = _cache("torch")
    assert (quiet.settings.debug_checks, checked.settings.debug_checks) == (False, True)
    too_far = 4 * BS  # one past the last slot of the 4 blocks
    for kv in (quiet, checked):
        view = kv.layer_kv_caches["l0"]
        view.copy_(torch.randn(view.shape))
    before = checked.layer_kv_caches["l0"].clone()
    metadata, q, k, v = _one_step(checked, "l0", too_far, seed=1)
    assert metadata.debug_checks is True
    with pytest.raises(ValueError, match=f"slot_mapping holds slot {too_far}"):
        backend = checked.attn_groups[0][0].backend
        backend.forward(q, k, v, checked.layer_kv_caches["l0"], metadata, head_size=8, scale=0.5)
    assert torch.equal(checked.layer_kv_caches["l0"], before)  # refused before anything was written
    # The first cache keeps what it read: its forward skips the bad slot though the environment now says 1.
    before = quiet.layer_kv_caches["l0"].clone()
    metadata, q, k, v = _one_step(quiet, "l0", too_far, seed=2)
    backend = quiet.attn_groups[0][0].backend
    out = backend.forward(q, k, v, quiet.layer_kv_caches["l0"], metadata, head_size=8, scale=0.5)
    assert torch.equal(quiet.layer_kv_caches["l0"], before) and torch.isfinite(out).all()


class _WatchedEnviron(dict):
    """A copy of the environment that records every variable read through it."""

    def __init__(self, environ):
        super().__init__(environ)
        self.read: list[str] = []

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.append(key)
        return super().__contains__(key)


def _backends():
    import os

    found = ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        found.append("triton")
    return found


@pytest.mark.parametrize("backend", _backends())
def test_forward_reads_no_environment(backend, monkeypatch):
    import os

    monkeypatch.setenv("KVCORE_DEBUG_CHECKS", "1")
    kv = _cache(backend)
    view = kv.layer_kv_caches["l0"]
    view.copy_(torch.randn(view.shape))
    metadata, q, k, v = _one_step(kv, "l0", BS + 4, seed=3)

    def refuse(*args, **kwargs):
        raise AssertionError("Settings.from_env called inside forward")

    watched = _WatchedEnviron(os.environ)
    monkeypatch.setattr(Settings, "from_env", classmethod(refuse))
    monkeypatch.setattr(os, "environ", watched)
    out = kv.attn_groups[0][0].backend.forward(q, k, v, view, metadata, head_size=8, scale=0.5)
    monkeypatch.undo()
    assert [name for name in watched.read if name.startswith("KVCORE_")] == []
    assert torch.isfinite(out).all()
    block, offset = divmod(BS + 4, BS)
    assert torch.equal(view[block, :, offset], torch.cat([k[0], v[0]], dim=-1))  # the step was written
