"""CPU tensors without the Triton interpreter get kvcore's message, not Triton's driver error."""

from __future__ import annotations

import pytest
import torch

from kvcore_triton import _checks
from kvcore_triton.store import write_kv


def test_cpu_tensors_without_interpreter_are_refused_before_any_launch(monkeypatch):
    # NOTE: Triton fixes the interpreter when it decorates the kernels; stand in for a compiled import.
    monkeypatch.setattr(_checks, "INTERPRETED", False)
    cache = torch.randn(4, 2, 16, 2 * 8)
    before = cache.clone()
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        write_kv(cache, key, value, torch.tensor([17, 18, 19]), 8)
    assert torch.equal(cache, before)
