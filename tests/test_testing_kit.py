"""kvcore.testing: the conformance kit's reference and caches are right."""

import torch
import torch.nn.functional as F

from kvcore.testing import build_cache, dense_reference, make_batch


def test_dense_reference_matches_sdpa_on_contiguous_kv():
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [9, 5], [9, 2], kv_heads=2, q_heads=4, head_size=8,
                       dtype=torch.float32, num_blocks=8, block_size=4)
    out = dense_reference(batch, scale=0.3)
    row = 0
    for keys, values, q_len, seq_len in zip(batch.keys, batch.values, batch.q_lens, batch.seq_lens):
        q = batch.query[row : row + q_len].transpose(0, 1)  # [Hq, q, D]
        k = keys.repeat_interleave(2, dim=1).transpose(0, 1)
        v = values.repeat_interleave(2, dim=1).transpose(0, 1)
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[row : row + q_len].float(), ref, atol=1e-5, rtol=1e-5)
        row += q_len


def test_batch_blocks_are_distinct_and_kernel_tables_split_them():
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(gen, [16, 11], [1, 11], kv_heads=1, q_heads=1, head_size=8,
                       dtype=torch.float32, num_blocks=16, block_size=8, ratio=2)
    ids = batch.manager_table.flatten().tolist()
    assert len(set(ids)) == len(ids)
    assert batch.kernel_table[:, ::2].tolist() == (batch.manager_table * 2).tolist()
    views = build_cache("LBNHC", 8, 16, 1, 8, torch.float32, kernel_block_size=4, device="cpu")
    assert views[0].shape == (32, 1, 4, 16)


def test_build_cache_gives_each_layer_its_own_memory():
    views = build_cache("BLNHC", 16, 6, 2, 8, torch.float32, num_layers=3, device="cpu")
    assert len(views) == 3
    for i, view in enumerate(views):
        view.fill_(float(i + 1))
    for i, view in enumerate(views):
        assert torch.all(view == i + 1)
