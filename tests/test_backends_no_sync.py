"""Neither backend's ``forward`` reads a tensor value on the host by default on a device.

A host read (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``nonzero``,
boolean-mask indexing) is a device sync on GPUs and breaks CUDA graph capture.
On CPU tensors the value checks run by default (they cost no sync), so these
tests turn them off the way a GPU run has them off (the metadata's
``debug_checks=False``, what ``KVCORE_DEBUG_CHECKS=0`` gives at ``KVCache.create``)
and record, through a dispatch mode, every aten op that copies a value to the
host. ``debug_checks=True`` or ``validate=True`` turns the checks back on.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.plugins.paged_inputs import DEBUG_CHECKS_ENV, value_checks
from kvcore.testing import build_cache, make_batch

#: aten ops whose result size or value the host must read (a sync on a device).
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive", "_unique2", "item"}


class HostReads(TorchDispatchMode):
    """Records every op that reads tensor values back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.seen.append(name)
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self.seen.append("index(bool mask)")
        return func(*args, **(kwargs or {}))


def _step(block_size: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [9, 6, 3], [1, 1, 1]
    view, _ = build_cache("LBNHC", block_size, 12, 2, 16, torch.float32, device="cpu")
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=2, q_heads=4, head_size=16, dtype=torch.float32,
                       num_blocks=12, block_size=block_size)
    slots = batch.slots(block_size, new_only=True)
    padded = torch.cat([slots, torch.tensor([-1])])  # one padding row past num_actual_tokens
    meta = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens_tensor,
        block_table_tensor=batch.kernel_table, slot_mapping=padded,
        num_reqs=3, num_actual_tokens=3, max_query_len=1, max_seq_len=9,
    )
    query = torch.cat([batch.query, torch.randn(1, 4, 16, generator=gen)])
    key, value = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    return view, query, key, value, meta


def _backends():
    from kvcore_torch import TorchAttentionBackend

    found = [pytest.param(TorchAttentionBackend, id="torch")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        from kvcore_triton import TritonAttentionBackend

        found.append(pytest.param(TritonAttentionBackend, id="triton"))
    return found


@pytest.mark.parametrize("backend", _backends())
def test_forward_reads_no_tensor_value_on_the_host(backend, monkeypatch):
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")  # NOTE: forward reads the metadata, not the environment
    view, query, key, value, meta = _step()
    meta = attrs.evolve(meta, debug_checks=False)
    with HostReads() as reads:
        out = backend.forward(query, key, value, view, meta, head_size=16, scale=0.25)
    assert reads.seen == [], f"{backend.name}.forward read tensor values on the host: {reads.seen}"
    assert out.shape == (3, 4, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", _backends())
def test_debug_switch_turns_the_value_checks_back_on(backend, monkeypatch):
    view, query, key, value, meta = _step()
    bad = CommonAttentionMetadata(
        query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, block_table_tensor=meta.block_table_tensor,
        slot_mapping=torch.tensor([0, 1, view.shape[0] * view.shape[2]]), num_reqs=3, num_actual_tokens=3,
        max_query_len=1, max_seq_len=9, debug_checks=True,
    )
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")
    before = view.clone()
    with pytest.raises(ValueError, match="slot_mapping holds slot"):
        backend.forward(query, key, value, view, bad, head_size=16, scale=0.25)
    assert torch.equal(view, before)
    backend.forward(query, key, value, view, attrs.evolve(bad, debug_checks=False), head_size=16, scale=0.25)
    # the bad slot is skipped
    expected = before.clone()
    for token, slot in enumerate((0, 1)):
        expected[slot // view.shape[2], :, slot % view.shape[2]] = torch.cat([key[token], value[token]], dim=-1)
    assert torch.equal(view, expected)


def test_the_recorder_sees_the_value_checks(monkeypatch):
    from kvcore_torch import TorchAttentionBackend

    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")
    view, query, key, value, meta = _step()
    with HostReads() as reads:
        TorchAttentionBackend.forward(query, key, value, view, attrs.evolve(meta, debug_checks=True),
                                      head_size=16, scale=0.25)
    assert reads.seen, "the recorder must see the host reads of the value checks"


def test_value_checks_switch(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)
    assert value_checks(None, cpu) and not value_checks(None, meta)
    assert not value_checks(False, cpu) and value_checks(True, meta)
    with pytest.raises(TypeError, match="validate"):
        value_checks(1, cpu)


@pytest.mark.parametrize("flag, on", [("1", True), ("true", True), ("0", False), ("off", False)])
def test_value_checks_environment(monkeypatch, flag, on):
    monkeypatch.setenv(DEBUG_CHECKS_ENV, flag)
    assert value_checks(None, torch.device("meta")) is on
    assert value_checks(None, torch.device("cpu")) is on
    assert value_checks(not on, torch.device("cpu")) is (not on)
