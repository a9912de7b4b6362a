"""The by-value kernel for short host lists, run through the Triton interpreter on CPU."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _table(chunks):
    return torch.tensor([[c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks]], dtype=torch.int64)


@pytest.mark.parametrize("seed", range(6))
def test_listed_ids_zero_exactly_their_chunks(seed):
    from kvcore.runtime.zeroer.listed import LISTED, launch_listed

    rng = random.Random(seed)
    vec, num_blocks = rng.choice([1, 2, 4]), rng.randint(2, 20)
    # Chunks (start, block stride, length) in vectors; every block's chunks lie inside the base.
    stride = rng.randint(3, 9)
    chunks = [(k, stride, rng.randint(1, 3)) for k in range(0, stride - 2, 3)]
    words = vec * (stride * num_blocks + 3)
    base = torch.randint(1, 1 << 30, (words,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    before = base.clone()
    ids = [rng.randrange(num_blocks) for _ in range(rng.randint(1, LISTED))]
    launch_listed(base, ids, num_blocks, _table(chunks), vec, programs=rng.randint(1, 5), rows=4, num_warps=1)
    expected = before.clone()
    for block in ids:
        for start, block_stride, length in chunks:
            first = (start + block * block_stride) * vec
            expected[first : first + length * vec] = 0
    assert torch.equal(base, expected)


def test_listed_launcher_refuses_what_it_cannot_pass_by_value():
    from kvcore.runtime.zeroer.listed import LISTED, launch_listed

    base, table = torch.ones(64, dtype=torch.int32), _table([(0, 4, 2)])
    for ids in ([], list(range(LISTED + 1)), [-1], [1 << 31]):
        with pytest.raises(ValueError, match="non-negative int32 ids"):
            launch_listed(base, ids, 8, table, 1, 2, 4, 1)
    assert torch.equal(base, torch.ones(64, dtype=torch.int32))


def _nested_chunks(rng):
    """Chunks at origin + i*s0 + j*s1 + k*s2 (one length, one block stride), and that stride."""
    n0, n1, n2 = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2)
    length = rng.randint(1, 3)
    s0 = length + rng.randint(0, 2)
    s1 = n0 * s0 + rng.randint(0, 3)
    s2 = n1 * s1 + rng.randint(0, 3)
    origin = rng.randint(0, 4)
    starts = [origin + i * s0 + j * s1 + k * s2 for k in range(n2) for j in range(n1) for i in range(n0)]
    stride = max(starts) + length + rng.randint(0, 3)
    return [(start, stride, length) for start in starts], stride


@pytest.mark.parametrize("seed", range(8))
def test_affine_geometry_by_value_zeroes_what_the_table_says(seed):
    from kvcore.runtime.zeroer.listed import LISTED, affine_form, launch_listed

    rng = random.Random(100 + seed)
    chunks, stride = _nested_chunks(rng)
    table = _table(chunks)
    form = affine_form(table)
    assert form is not None and form[1:3] == (stride, chunks[0][2])
    vec, num_blocks = rng.choice([1, 2, 4]), rng.randint(2, 12)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(1, 1 << 30, (vec * stride * num_blocks,), dtype=torch.int32, generator=gen)
    by_table, by_value = base.clone(), base.clone()
    ids = [rng.randrange(num_blocks) for _ in range(rng.randint(1, LISTED))]
    launch_listed(by_table, ids, num_blocks, table, vec, 3, 4, 1)
    launch_listed(by_value, ids, num_blocks, table, vec, 3, 4, 1, affine=form)
    assert torch.equal(by_value, by_table) and not torch.equal(by_table, base)


def test_tables_without_an_affine_form_keep_the_table():
    from kvcore.runtime.zeroer.listed import affine_form, launch_listed

    assert affine_form(_table([(0, 8, 2), (2, 8, 2), (5, 8, 2)])) is None  # uneven steps
    assert affine_form(_table([(0, 8, 2), (2, 8, 1)])) is None  # two lengths
    assert affine_form(_table([(0, 8, 2), (2, 9, 2)])) is None  # two block strides
    assert affine_form(_table([(0, 9, 1), (1, 9, 1), (2, 9, 1), (5, 9, 1), (6, 9, 1)])) is None  # 3 + 2
    assert affine_form(_table([(4, 9, 1)])) == (4, 9, 1, 1, 0, 1, 0, 0)
    table = _table([(0, 8, 2), (2, 8, 2), (5, 8, 2)])
    with pytest.raises(ValueError, match="affine_form"):
        launch_listed(torch.ones(64, dtype=torch.int32), [1], 8, table, 1, 2, 4, 1, affine=(0, 8, 2, 3, 2, 1, 0, 0))
