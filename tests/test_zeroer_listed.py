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
