"""kvcore.hf.Engine's defaults: "auto" per layer, the backend's block size, the step budget by device."""

from __future__ import annotations

import pytest
import torch

from kvcore.hf.defaults import BATCHED_TOKENS, BLOCK_SIZE, resolve, warm_up
from kvcore.specs import FullAttentionSpec, SlidingWindowSpec

pytest.importorskip("kvcore_triton")


def _specs(size):
    return {
        "l0": FullAttentionSpec(size, 2, 64, torch.bfloat16),
        "l1": SlidingWindowSpec(size, 2, 64, torch.bfloat16, sliding_window=32),
    }


def test_cpu_auto_keeps_todays_defaults():
    got = resolve(_specs, torch.device("cpu"), "auto", None, None)
    assert (got.block_size, got.max_num_batched_tokens) == (BLOCK_SIZE, BATCHED_TOKENS["cpu"]) == (16, 2048)
    assert {b.name for b in got.layer_backends.values()} == {"torch"}


def test_cuda_auto_takes_the_preferred_backend_and_its_block_size():
    # Asked about a CUDA device without one: requirements and priorities only.
    got = resolve(_specs, torch.device("cuda"), "auto", None, None)
    assert {b.name for b in got.layer_backends.values()} == {"triton"}
    assert got.block_size == 64 and got.max_num_batched_tokens == 4096


def test_explicit_values_win():
    got = resolve(_specs, torch.device("cuda"), "flashinfer", 32, 512)
    assert (got.block_size, got.max_num_batched_tokens) == (32, 512)
    assert set(got.layer_backends.values()) == {"flashinfer"}
    # FlashInfer takes any page size and states no preference: 16.
    assert resolve(_specs, torch.device("cuda"), "flashinfer", None, None).block_size == 16


def test_warm_up_captures_every_missing_size_once():
    class Graphs:
        sizes, graphs, captured = [1, 2, 4], {2: object()}, []

        def capture_size(self, size):
            self.captured.append(size)

    graphs = Graphs()
    warm_up(graphs, progress=False)
    assert graphs.captured == [1, 4]
