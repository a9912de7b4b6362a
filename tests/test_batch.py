"""Batch helpers: uniform decode batches, multimodal placeholders, encoder stats."""

from __future__ import annotations

import pytest
import torch

from kvcore.model_runner import get_uniform_decode_token_count, is_uniform_query_len
from kvcore.model_runner.multimodal import (
    EncoderTimingStats,
    gather_mm_placeholders,
    sanity_check_mm_encoder_outputs,
    scatter_mm_placeholders,
)


@pytest.mark.parametrize(
    "num_reqs, num_tokens, max_query_len, uniform",
    [(4, 4, 1, True), (4, 12, 3, True), (4, 11, 3, False), (0, 0, 1, False), (1, 7, 7, True)],
)
def test_is_uniform_query_len(num_reqs, num_tokens, max_query_len, uniform):
    assert is_uniform_query_len(num_reqs, num_tokens, max_query_len) is uniform


def test_uniform_decode_token_count_needs_eligibility():
    assert get_uniform_decode_token_count(8, 16, 2, True) == 2
    assert get_uniform_decode_token_count(8, 16, 2, False) is None
    assert get_uniform_decode_token_count(8, 15, 2, True) is None


def test_scatter_then_gather_round_trips():
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(5, 3, generator=gen)
    is_embed = torch.tensor([False, True, True, False, True, True, False, True])
    placed = scatter_mm_placeholders(embeds, is_embed)
    assert placed.shape == (8, 3)
    assert torch.isnan(placed[~is_embed]).all()
    assert torch.equal(placed[is_embed], embeds)
    assert torch.equal(gather_mm_placeholders(placed, is_embed), embeds)


def test_no_mask_is_identity():
    embeds = torch.randn(4, 2)
    assert scatter_mm_placeholders(embeds, None) is embeds
    assert gather_mm_placeholders(embeds, None) is embeds


def test_scatter_rejects_a_mask_of_the_wrong_count():
    with pytest.raises(ValueError, match="marks 2 positions but there are 3 embeddings"):
        scatter_mm_placeholders(torch.randn(3, 2), torch.tensor([True, True, False]))
    with pytest.raises(ValueError, match="1-D bool mask"):
        scatter_mm_placeholders(torch.randn(3, 2), torch.tensor([1, 1, 1]))


@pytest.mark.parametrize(
    "outputs", [[torch.randn(3, 4), torch.randn(5, 4)], (torch.randn(3, 4), torch.randn(1, 4)), torch.randn(2, 3, 4)]
)
def test_sanity_check_accepts_one_2d_tensor_per_item_and_counts_them(outputs):
    assert sanity_check_mm_encoder_outputs(outputs, 2) is None
    with pytest.raises(ValueError, match="expected 3 multimodal embeddings.*got 2"):
        sanity_check_mm_encoder_outputs(outputs, 3)


@pytest.mark.parametrize(
    "outputs, expected, match",
    [
        ({"a": torch.randn(2, 2)}, 1, "got dict"),
        ([torch.randn(2, 2)], 2, "expected 2 multimodal embeddings.*got 1"),
        ([torch.randn(2, 2), torch.randn(2)], 2, r"must be 2-D, got shapes \[\(2, 2\), \(2,\)\]"),
        (torch.randn(2, 3), 2, "must be 2-D"),
    ],
)
def test_sanity_check_raises_value_error(outputs, expected, match):
    with pytest.raises(ValueError, match=match):
        sanity_check_mm_encoder_outputs(outputs, expected)


def test_encoder_timing_stats_report_what_was_accumulated():
    gen = torch.Generator().manual_seed(4)
    durations = (torch.rand(5, generator=gen) + 0.1).tolist()
    stats = EncoderTimingStats()
    for seconds in durations:
        stats.encoder_forward_secs += seconds
        stats.num_encoder_calls += 1
    report = stats.to_dict()
    assert report["num_encoder_calls"] == 5
    assert report["encoder_forward_secs"] == pytest.approx(sum(durations))
