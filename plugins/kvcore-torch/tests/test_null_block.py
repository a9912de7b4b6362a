"""Block 0, the null block, is what padded and out-of-window block-table entries point at: its
bytes (NaN included, as memory used before may hold) never reach an output."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch_paged_cases import LAYOUTS, build_cache, dense_reference, make_batch

from kvcore_torch import paged_attention, write_kv

SEQ_LENS, Q_LENS, BLOCK = [13, 21, 6, 9], [13, 2, 1, 0], 4


def _batch_over_a_null_block(gen, num_blocks, window):
    """A batch whose tables use blocks 1.. and point padding (and, with ``window``, the blocks
    wholly before every query's window) at block 0, as the engine's scheduler does."""
    batch = make_batch(gen, SEQ_LENS, Q_LENS, kv_heads=2, q_heads=4, head_size=8, dtype=torch.float32,
                       num_blocks=num_blocks - 1, block_size=BLOCK)
    table = batch.manager_table + 1
    for i, (n, q) in enumerate(zip(SEQ_LENS, Q_LENS)):
        table[i, -(-n // BLOCK):] = 0
        if window is not None:
            table[i, : max(0, n - q - window + 1) // BLOCK] = 0
    return attrs.evolve(batch, manager_table=table, kernel_table=table)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("validate", [None, False], ids=["host-lengths", "no-host-reads"])
def test_nan_in_the_null_block_changes_no_output(layout, window, validate):
    gen = torch.Generator().manual_seed(11)
    num_blocks = len(SEQ_LENS) * -(-max(SEQ_LENS) // BLOCK) + 1
    view, _ = build_cache(layout, BLOCK, num_blocks, 2, 8, torch.float32)
    batch = _batch_over_a_null_block(gen, num_blocks, window)
    write_kv(view, batch.tokens(batch.keys, False), batch.tokens(batch.values, False), batch.slots(BLOCK, False), 8)
    write_kv(view, batch.tokens(batch.keys, True), batch.tokens(batch.values, True), batch.slots(BLOCK, True), 8)
    view[0] = float("nan")  # NOTE: after the writes: tokens out of the window went to block 0
    bounds = {} if validate is None else {"max_query_len": max(Q_LENS), "max_seq_len": max(SEQ_LENS)}
    out = paged_attention(batch.query, view, batch.kernel_table, batch.query_start_loc, batch.seq_lens_tensor,
                          head_size=8, scale=8**-0.5, sliding_window=window, validate=validate, **bounds)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_reference(batch, 8**-0.5, window), atol=1e-5, rtol=1e-5)
