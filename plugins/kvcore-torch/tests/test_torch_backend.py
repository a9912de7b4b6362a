"""The torch backend writes K/V to the right slots and matches dense attention."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_paged_cases import LAYOUTS, SPLITTABLE, build_cache, dense_reference, make_batch

from kvcore_torch import attention as torch_attention
from kvcore_torch import paged_attention, write_kv

# Mixed batch: full prefill, chunked prefill, decode, and an idle request.
SEQ_LENS = [13, 21, 9, 6]
Q_LENS = [13, 5, 1, 0]


def _run(layout, block_size, *, ratio=1, kv_heads=2, q_heads=4, head_size=8, dtype=torch.float32,
         sliding_window=None, seq_lens=SEQ_LENS, q_lens=Q_LENS, seed=0, validate=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * max(-(-n // block_size) for n in seq_lens) + 3
    kernel_block_size = block_size // ratio
    view, other = build_cache(
        layout, block_size, num_blocks, kv_heads, head_size, dtype,
        kernel_block_size=kernel_block_size if ratio > 1 else None,
    )
    assert view.shape[2] == kernel_block_size and view.shape[0] == num_blocks * ratio
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=kv_heads, q_heads=q_heads, head_size=head_size,
                       dtype=dtype, num_blocks=num_blocks, block_size=block_size, ratio=ratio)
    # Two steps: the cached prefix, then this step's new tokens.
    for new_only in (False, True):
        write_kv(view, batch.tokens(batch.keys, new_only), batch.tokens(batch.values, new_only),
                 batch.slots(kernel_block_size, new_only), head_size)
    scale = head_size**-0.5
    # NOTE: validate=False takes the GPU path (no host reads, chunks padded to the batch's bounds).
    bounds = {} if validate is not False else {"max_query_len": max(q_lens), "max_seq_len": max(seq_lens)}
    out = paged_attention(batch.query, view, batch.kernel_table, batch.query_start_loc, batch.seq_lens_tensor,
                          head_size=head_size, scale=scale, sliding_window=sliding_window, validate=validate,
                          **bounds)
    return out, dense_reference(batch, scale, sliding_window), view, other, batch


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_reference_in_every_layout(layout, block_size):
    out, ref, _, other, _ = _run(layout, block_size)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(other) == 0, "write_kv touched another layer"


@pytest.mark.parametrize("layout", SPLITTABLE, ids=lambda x: x.name)
def test_split_manager_blocks_into_kernel_blocks(layout):
    seq_lens, q_lens = [150, 40, 129], [22, 1, 129]
    out, ref, _, _, batch = _run(layout, 128, ratio=4, seq_lens=seq_lens, q_lens=q_lens, head_size=4)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The kernel slot of a token equals its manager slot: b*128 + o == (b*4 + o//32)*32 + o%32.
    manager_slots = [int(batch.manager_table[i, p // 128]) * 128 + p % 128
                     for i, n in enumerate(seq_lens) for p in range(n - q_lens[i])]
    assert batch.slots(32, new_only=False).tolist() == manager_slots


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("window", [1, 4, 11])
def test_sliding_window(layout, window):
    out, ref, *_ = _run(layout, 4, sliding_window=window, kv_heads=1, q_heads=3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache():
    out, ref, *_ = _run("LBNHC", 16, dtype=torch.bfloat16, head_size=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_written_bytes_land_in_their_slots():
    _, _, view, _, batch = _run("BHLNC", 4, head_size=8)
    for i, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        for pos in range(keys.shape[0]):
            block, offset = int(batch.kernel_table[i, pos // 4]), pos % 4
            torch.testing.assert_close(view[block, :, offset, :8], keys[pos], rtol=0, atol=0)
            torch.testing.assert_close(view[block, :, offset, 8:], values[pos], rtol=0, atol=0)


@pytest.mark.parametrize("budget", [None, 1], ids=["one-chunk", "chunk-per-request"])
@pytest.mark.parametrize("validate", [None, False], ids=["host-lengths", "no-host-reads"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    layout=st.sampled_from(LAYOUTS),
    block_size=st.integers(1, 9),
    group=st.integers(1, 3),
    window=st.one_of(st.none(), st.integers(1, 12)),
    reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_any_batch_matches_reference(budget, validate, layout, block_size, group, window, reqs, seed):
    """For any mixed batch, layout and block size, paged attention equals dense attention.

    Both ways of chunking requests: grouped by host-known query length (value
    checks on), and padded to the batch's bounds with no host read (checks off);
    in one chunk, and one request per chunk (a budget of one element).
    """
    seq_lens = [n for n, _ in reqs]
    q_lens = [min(q, n) for n, q in reqs]
    with mock.patch.object(torch_attention, "CHUNK_ELEMENTS", budget or torch_attention.CHUNK_ELEMENTS):
        out, ref, *_ = _run(layout, block_size, kv_heads=2, q_heads=2 * group, head_size=4, sliding_window=window,
                            seq_lens=seq_lens, q_lens=q_lens, seed=seed, validate=validate)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_out_of_range_slot_is_refused_and_nothing_written():
    (view, _) = build_cache("LBNHC", 4, 3, 2, 8, torch.float32)
    key = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="slot 12"):
        write_kv(view, key, key.clone(), torch.tensor([0, 12]), 8)
    assert torch.count_nonzero(view) == 0


def test_negative_slots_are_padding():
    (view, _) = build_cache("BLNHC", 4, 3, 2, 8, torch.float32)
    key = torch.randn(2, 2, 8)
    write_kv(view, key, key + 1, torch.tensor([-1, 5]), 8)
    torch.testing.assert_close(view[1, :, 1, :8], key[1])
    assert torch.count_nonzero(view) == 2 * 16


def test_bad_inputs_name_the_problem():
    (view, _) = build_cache("LBNHC", 4, 3, 2, 8, torch.float32)
    q = torch.randn(3, 3, 8)
    qsl, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="3 query heads"):
        paged_attention(q, view, table, qsl, lens, head_size=8, scale=1.0)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        paged_attention(q[:, :2], view, table, qsl, torch.tensor([5], dtype=torch.int32), head_size=8, scale=1.0)
    with pytest.raises(ValueError, match="seq_len 2"):
        paged_attention(q[:, :2], view, table, qsl, torch.tensor([2], dtype=torch.int32), head_size=8, scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        write_kv(view, torch.randn(1, 2, 8).double(), torch.randn(1, 2, 8), torch.tensor([0]), 8)
    with pytest.raises(ValueError, match="block ids"):
        paged_attention(q[:, :2], view, table + 7, qsl, lens, head_size=8, scale=1.0)


@pytest.mark.parametrize("query_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_query_in_another_dtype_than_the_cache_is_refused_like_triton_does(query_dtype):
    """One rule for both backends: cast the query to the cache's dtype first (no silent up/downcast)."""
    (view, _) = build_cache("LBNHC", 4, 3, 2, 8, torch.float32)
    view.copy_(torch.randn(view.shape))
    q = torch.randn(3, 4, 8).to(query_dtype)
    qsl, lens = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    table = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match=f"query has dtype {query_dtype} but the KV cache holds torch.float32; cast it"):
        paged_attention(q, view, table, qsl, lens, head_size=8, scale=1.0)
    out = paged_attention(q.float(), view, table, qsl, lens, head_size=8, scale=1.0)
    assert out.dtype == torch.float32 and out.abs().sum() > 0
