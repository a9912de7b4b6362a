"""The builder's page tables against a plain per-request reference, on random block tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.specs import FullAttentionSpec
from kvcore_flashinfer import FlashInferMetadataBuilder, page_table


def _reference(table, seq_lens, page_size):
    indptr, indices, last = [0], [], []
    for row, n in zip(table.tolist(), seq_lens.tolist()):
        pages = -(-n // page_size)
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if n else 0)
    return indptr, indices, last


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 16, 64]),
    lens=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    extra_rows=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_page_table_matches_reference(page_size, lens, extra_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page_size) for n in lens)) + 1
    table = torch.randint(1, 10_000, (len(lens) + extra_rows, width), generator=gen, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = page_table(table, seq_lens, page_size)
    indptr, indices, last = _reference(table[: len(lens)], seq_lens, page_size)
    assert got.indptr.tolist() == indptr and got.indices.tolist() == indices and got.last_page_len.tolist() == last
    assert got.indptr.dtype == got.indices.dtype == got.last_page_len.dtype == torch.int32
    assert all(1 <= x <= page_size for x, n in zip(last, lens) if n)


def test_page_table_refuses_a_short_row_and_bad_page_size():
    table = torch.ones(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="request 0 has 40 tokens"):
        page_table(table, torch.tensor([40]), 16)
    with pytest.raises(ValueError, match="page_size"):
        page_table(table, torch.tensor([4]), 0)


def test_builder_packs_each_step_once_for_every_layer():
    spec = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    builder = FlashInferMetadataBuilder(spec, ["a", "b"], "cpu", max_num_seqs=4, max_model_len=256)
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(1, 50, (3, 8), generator=gen, dtype=torch.int32)
    ints = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    common = CommonAttentionMetadata(
        query_start_loc=ints([0, 17, 23, 24]), seq_lens=ints([17, 40, 9]), block_table_tensor=table,
        slot_mapping=torch.zeros(24, dtype=torch.int64), num_reqs=3, num_actual_tokens=24,
        max_query_len=17, max_seq_len=40,
    )
    metadata = builder.build(0, common)
    indptr, indices, last = _reference(table, common.seq_lens, 16)
    assert metadata.pages.indptr.tolist() == indptr and metadata.pages.indices.tolist() == indices
    assert metadata.pages.last_page_len.tolist() == last
    assert metadata.qo_indptr.tolist() == [0, 17, 23, 24] and metadata.graph_size is None
    assert builder.num_plans == 0  # planning waits for the first layer's forward (query heads, dtype)
