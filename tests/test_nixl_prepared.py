"""NixlAgent's prepared descriptor lists address exactly the bytes the transfer plan moves.

``PreparedRuns`` turns a cache's block patterns into NIXL's Nx5 strided rows (one per run,
``count`` = blocks); a transfer names descriptors ``run * num_blocks + block``. Checked here
without NIXL: the bytes those indices cover are the plan's bytes, and the copies NIXL makes
after merging equal the paired plan's.
"""

from __future__ import annotations

import pytest
import torch
from _transfer_caches import KINDS, make_cache
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numpy")
from kvcore.transfer import describe, plan_transfer  # noqa: E402
from kvcore.transfer.nixl_api import PreparedRuns, paired_indices  # noqa: E402
from kvcore.transfer.pairs import pair_runs  # noqa: E402
from kvcore.transfer.regions import group_selection, whole_block_patterns  # noqa: E402

CASES = [(kind, layout) for kind, layouts in KINDS.items() for layout in layouts]


def _covered(intervals) -> set[int]:
    return {byte for start, length in intervals for byte in range(start, start + length)}


def _prepared(kind: str, layout: str, num_blocks: int):
    desc = describe(make_cache(kind, layout, num_blocks=num_blocks))
    groups = group_selection(desc, None)
    patterns = whole_block_patterns(desc, groups)
    return desc, patterns, PreparedRuns(desc, patterns)


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(CASES), ids=st.sets(st.integers(1, 6), min_size=1, max_size=4))
def test_prepared_indices_cover_exactly_the_planned_bytes(case, ids):
    desc, _, prepared = _prepared(*case, num_blocks=7)
    rows = prepared.rows()
    assert len(rows) == len(prepared.starts) and all(int(r[4]) == 7 for r in rows)
    index, addresses = prepared.indices(torch.tensor(sorted(ids)))
    run, block = index // 7, index % 7
    expanded = rows[run, 0].astype("int64") + rows[run, 3].astype("int64") * block
    assert (expanded == addresses.numpy()).all()
    from_indices = _covered(zip(addresses.tolist(), rows[run, 1].astype("int64").tolist()))
    planned = set()
    for group in group_selection(desc, None):
        regions = plan_transfer(desc, sorted(ids), group_id=group)
        bases = [desc.allocations[r.allocation].base_ptr for r in regions]
        planned |= _covered((base + r.offset, r.length) for base, r in zip(bases, regions))
    assert from_indices == planned


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(KINDS["uniform"]),
    pairs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=1, max_size=5,
                   unique_by=(lambda p: p[0], lambda p: p[1])),
)
def test_copies_after_merging_equal_the_paired_plan(layout, pairs):
    _, local_patterns, local = _prepared("uniform", layout, num_blocks=7)
    _, far_patterns, far = _prepared("uniform", layout, num_blocks=9)
    loc, rem = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    local_index, remote_index, runs, nbytes = paired_indices(local, far, loc, rem)
    plan = pair_runs(local_patterns, loc, far_patterns, rem)
    assert runs == sum(p.num_runs for p in plan) and nbytes == sum(p.nbytes for p in plan)
    assert len(local_index) == len(remote_index) == len(pairs) * len(local.starts)
