"""The Triton kernels match dense attention in every layout (CPU: Triton interpreter).

Shapes stay tiny (2-3 requests, <= 40 tokens, head size 16/32, 2 KV heads)
so the interpreter runs each case in well under a second.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_paged_cases import DEVICE, LAYOUTS, SPLITTABLE, build_cache, dense_reference, make_batch

from kvcore_triton import KernelConfig, paged_attention, write_kv

DECODE = ([23, 40], [1, 1])
MIXED = ([17, 40, 9], [17, 6, 1])  # full prefill, chunked prefill, decode


def _run(layout, block_size, reqs, *, ratio=1, q_heads=4, head_size=16, dtype=torch.float32,
         sliding_window=None, config=None, seed=0, device=DEVICE):
    seq_lens, q_lens = reqs
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * max(-(-n // block_size) for n in seq_lens) + 2
    kernel_block_size = block_size // ratio
    view, other = build_cache(layout, block_size, num_blocks, 2, head_size, dtype, device=device,
                              kernel_block_size=kernel_block_size if ratio > 1 else None)
    batch = make_batch(gen, seq_lens, q_lens, kv_heads=2, q_heads=q_heads, head_size=head_size, dtype=dtype,
                       num_blocks=num_blocks, block_size=block_size, ratio=ratio)
    for new_only in (False, True):
        write_kv(view, batch.tokens(batch.keys, new_only).to(device), batch.tokens(batch.values, new_only).to(device),
                 batch.slots(kernel_block_size, new_only).to(device), head_size)
    scale = head_size**-0.5
    out = paged_attention(
        batch.query.to(device), view, batch.kernel_table.to(device), batch.query_start_loc.to(device),
        batch.seq_lens_tensor.to(device), head_size=head_size, scale=scale, sliding_window=sliding_window,
        config=config or KernelConfig(tile=16),
    )
    return out.cpu(), dense_reference(batch, scale, sliding_window), view, other


def _small_batch(seed, layout, num_blocks, table, query_start_loc, seq_lens):
    """A random float32 cache (16-token blocks, 2 KV heads, D=16) and a 4-query-head batch on it."""
    gen = torch.Generator().manual_seed(seed)
    view, _ = build_cache(layout, 16, num_blocks, 2, 16, torch.float32)
    view.copy_(torch.randn(view.shape, generator=gen))
    q = torch.randn(query_start_loc[-1], 4, 16, generator=gen).to(DEVICE)
    ints = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return view, ints(table), q, ints(query_start_loc), ints(seq_lens)


def _close(out, ref, tol=1e-5):
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_matches_dense_reference_in_every_layout(layout, reqs):
    out, ref, _, other = _run(layout, 16, reqs)
    _close(out, ref)
    assert torch.count_nonzero(other) == 0, "write_kv touched another layer"


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_each_kernel_block_size(block_size, reqs):
    out, ref, *_ = _run("BLNHC", block_size, reqs, head_size=32)
    _close(out, ref)


@pytest.mark.parametrize("layout", SPLITTABLE, ids=lambda x: x.name)
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_manager_block_of_128_split_into_32_token_kernel_blocks(layout, reqs):
    out, ref, view, _ = _run(layout, 128, reqs, ratio=4)
    assert view.shape[2] == 32
    _close(out, ref)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_splits_agree(num_splits):
    out, ref, *_ = _run("LBNHC", 16, DECODE, config=KernelConfig(tile=16, num_splits=num_splits))
    _close(out, ref)


@pytest.mark.parametrize("num_splits", [None, 1, 2])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_past_max_seq_len_still_attends_every_token(num_splits, window):
    # A CUDA graph captured for max_seq_len=16 replayed on contexts of 23 and 40 tokens.
    kvcore_torch = pytest.importorskip("kvcore_torch")
    view, table, q, qsl, lens = _small_batch(5, "LBNHC", 8, [[6, 1, 3], [2, 7, 4]], [0, 1, 2], [23, 40])
    kwargs = dict(head_size=16, scale=0.3, sliding_window=window)
    ours = paged_attention(q, view, table, qsl, lens, **kwargs, max_query_len=1, max_seq_len=16,
                           config=KernelConfig(tile=16, num_splits=num_splits))
    theirs = kvcore_torch.paged_attention(q, view, table, qsl, lens, **kwargs)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [1, 5, 24])
def test_sliding_window(reqs, window):
    out, ref, *_ = _run("LBHNC", 16, reqs, sliding_window=window, config=KernelConfig(tile=16, num_splits=2))
    _close(out, ref)


@pytest.mark.parametrize("q_heads", [2, 8])
def test_gqa_group_sizes(q_heads):
    out, ref, *_ = _run("BHLNC", 16, MIXED, q_heads=q_heads)
    _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    out, ref, *_ = _run("LBNHC", 16, MIXED, dtype=dtype, head_size=32)
    assert out.dtype == dtype
    _close(out, ref, tol=3e-2)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=3),
    decode=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_batches_match_reference(layout, block_size, window, reqs, decode, seed):
    """Any small batch (decode-only or mixed, idle requests included) equals dense attention."""
    seq_lens = [n for n, _ in reqs]
    q_lens = [min(1 if decode else q, n) for n, q in reqs]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    out, ref, *_ = _run(layout, block_size, (seq_lens, q_lens), sliding_window=window, seed=seed)
    _close(out, ref)


def test_agrees_with_torch_backend():
    kvcore_torch = pytest.importorskip("kvcore_torch")
    view, table, q, qsl, lens = _small_batch(3, "BLNHC", 6, [[4, 1, 0], [2, 5, 3]], [0, 6, 7], [30, 41])
    kwargs = dict(head_size=16, scale=0.3)
    ours = paged_attention(q, view, table, qsl, lens, **kwargs, config=KernelConfig(tile=16))
    theirs = kvcore_torch.paged_attention(q, view, table, qsl, lens, **kwargs)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
def test_store_matches_torch_indexing(layout):
    view, other = build_cache(layout, 16, 4, 2, 16, torch.float32)
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([63, -1, 0, 17, 40])
    write_kv(view, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), 16)
    view = view.cpu()
    expected = torch.zeros_like(view)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, :, slot % 16] = torch.cat([key[t], value[t]], dim=-1)
    torch.testing.assert_close(view, expected, atol=0, rtol=0)
    assert torch.count_nonzero(other) == 0


def test_store_refuses_out_of_range_slots_and_writes_nothing():
    view, _ = build_cache("LBNHC", 16, 2, 2, 16, torch.float32)
    key, slots = torch.randn(2, 2, 16, device=DEVICE), torch.tensor([1, 32], device=DEVICE)
    with pytest.raises(ValueError, match="slot 32"):
        write_kv(view, key, key, slots, 16, validate=True)
    assert torch.count_nonzero(view) == 0
    write_kv(view, key, key, slots, 16, validate=False)  # skipped, never out of bounds
    assert torch.count_nonzero(view) == 2 * 32


def test_bad_inputs_name_the_problem():
    view, _ = build_cache("LBNHC", 16, 2, 2, 16, torch.float32)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="3 query heads"):
        paged_attention(torch.randn(1, 3, 16, device=DEVICE), view, table, qsl, lens, head_size=16, scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(torch.randn(1, 2, 16, device=DEVICE).half(), view, table, qsl, lens, head_size=16, scale=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(torch.randn(1, 2, 40, device=DEVICE), view, table, qsl, lens, head_size=40, scale=1.0)
    with pytest.raises(TypeError, match="int32 or int64"):
        paged_attention(torch.randn(1, 2, 16, device=DEVICE), view, table.float(), qsl, lens, head_size=16, scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(tile=24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LHBNC"])
def test_gpu_bf16_matches_reference(layout):
    reqs = ([300, 1000, 77, 513], [1, 1, 1, 1])
    out, ref, *_ = _run(layout, 64, reqs, q_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda",
                        config=KernelConfig())
    _close(out, ref, tol=3e-2)
    reqs = ([300, 1000, 77], [300, 20, 1])
    out, ref, *_ = _run(layout, 64, reqs, q_heads=8, head_size=128, dtype=torch.bfloat16, device="cuda",
                        config=KernelConfig(), sliding_window=128)
    _close(out, ref, tol=3e-2)


def test_tma_descriptor_only_where_a_tile_fits_one_block():
    from kvcore_triton.attention import _tma_descriptor

    view, *_ = _small_batch(0, "BLNHC", 4, [[0]], [0, 1], [5])
    assert _tma_descriptor(view, KernelConfig(tile=16), 16, 16) is not None
    assert _tma_descriptor(view, KernelConfig(tile=32), 16, 16) is None  # spans two 16-token blocks
    assert _tma_descriptor(view, KernelConfig(tile=16, tma=False), 16, 16) is None
    assert _tma_descriptor(view[..., :24], KernelConfig(tile=16), 12, 12) is None  # head not a power of two


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, None), (2, 9)])
def test_rows_past_the_context_may_hold_nan(tma, num_splits, window):
    """Unused slots of a request's last block (and unused blocks) are never mixed into the output."""
    kvcore_torch = pytest.importorskip("kvcore_torch")
    view, table, q, qsl, lens = _small_batch(7, "LBNHC", 6, [[4, 1, 0], [2, 5, 3]], [0, 1, 2], [23, 40])
    clean = view.clone()
    for row, length in zip(table.tolist(), lens.tolist()):
        for i, block in enumerate(row):
            view[block, :, max(0, length - 16 * i):] = float("nan")
    kwargs = {"head_size": 16, "scale": 0.3, "sliding_window": window}
    ours = paged_attention(q, view, table, qsl, lens, **kwargs,
                           config=KernelConfig(tile=16, num_splits=num_splits, tma=tma))
    theirs = kvcore_torch.paged_attention(q, clean, table, qsl, lens, **kwargs)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
