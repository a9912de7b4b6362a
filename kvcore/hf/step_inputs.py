"""One step's model inputs and attention metadata, built from the scheduled requests.

All tokens of a step are packed into one row (``input_ids``/``position_ids``
of shape ``[1, T]``); request ``i`` owns columns
``query_start_loc[i]:query_start_loc[i + 1]``. Each KV cache group gets its
own block table (rows sliced from the scheduler's arrays) and slot mapping;
a state group's table is each request's one state slot (its mixers read the
slots themselves; no attention backend reads that group's metadata). Host
arrays are built with numpy and moved in two copies (int64, int32).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.hf.requests import Request


@attrs.frozen(eq=False)
class StepInputs:
    """Device tensors for one forward pass, and which requests sample a token from it."""

    input_ids: torch.Tensor = attrs.field(repr=False)
    position_ids: torch.Tensor = attrs.field(repr=False)
    #: Column of each sampling request's last token, in ``sampled`` order.
    logits_indices: torch.Tensor = attrs.field(repr=False)
    sampled: list[Request] = attrs.field(repr=False)
    common: list[CommonAttentionMetadata] = attrs.field(repr=False)
    num_tokens: int


def build_step_inputs(
    batch: list[tuple[Request, int]],
    tables: list[np.ndarray],
    block_sizes: list[int],
    device: torch.device,
    state_groups: Sequence[bool] = (),
) -> StepInputs:
    """Pack ``batch`` (requests and their token counts) into model inputs and per-group metadata.

    ``state_groups[g]`` is true for a state group (one block per request).
    """
    num_reqs = len(batch)
    counts = np.fromiter((n for _, n in batch), dtype=np.int64, count=num_reqs)
    computed = np.fromiter((r.num_computed for r, _ in batch), dtype=np.int64, count=num_reqs)
    rows = np.fromiter((r.row for r, _ in batch), dtype=np.int64, count=num_reqs)
    seq_lens = computed + counts
    starts = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    num_tokens = int(starts[-1])
    owner = np.repeat(np.arange(num_reqs), counts)
    positions = computed[owner] + np.arange(num_tokens) - starts[owner]
    tokens = np.fromiter(
        itertools.chain.from_iterable(r.tokens[r.num_computed : r.num_computed + n] for r, n in batch),
        dtype=np.int64, count=num_tokens,
    )
    sampling = np.fromiter((r.num_computed + n == r.num_tokens for r, n in batch), dtype=bool, count=num_reqs)
    logits_indices = starts[1:][sampling] - 1
    max_seq_len = int(seq_lens.max())
    group_tables, slots = [], []
    for g, (table, size) in enumerate(zip(tables, block_sizes)):
        if g < len(state_groups) and state_groups[g]:
            rows_table = table[rows, :1]
            group_tables.append(rows_table)
            slots.append(rows_table[owner, 0].astype(np.int64) * size)
            continue
        rows_table = table[rows, : -(-max_seq_len // size)]
        group_tables.append(rows_table)
        slots.append(rows_table[owner, positions // size].astype(np.int64) * size + positions % size)
    longs = torch.from_numpy(np.concatenate([tokens, positions, logits_indices, *slots])).to(device)
    ints = torch.from_numpy(
        np.concatenate([starts.astype(np.int32), seq_lens.astype(np.int32), *(t.ravel() for t in group_tables)])
    ).to(device)
    num_sampled = len(logits_indices)
    input_ids, position_ids = longs[:num_tokens], longs[num_tokens : 2 * num_tokens]
    offset = 2 * num_tokens + num_sampled
    query_start_loc, seq_lens_t = ints[: num_reqs + 1], ints[num_reqs + 1 : 2 * num_reqs + 1]
    int_offset = 2 * num_reqs + 1
    common = []
    for rows_table in group_tables:
        block_table = ints[int_offset : int_offset + rows_table.size].view(rows_table.shape)
        int_offset += rows_table.size
        common.append(
            CommonAttentionMetadata(
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_t,
                block_table_tensor=block_table,
                slot_mapping=longs[offset : offset + num_tokens],
                num_reqs=num_reqs,
                num_actual_tokens=num_tokens,
                max_query_len=int(counts.max()),
                max_seq_len=max_seq_len,
            )
        )
        offset += num_tokens
    return StepInputs(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        logits_indices=longs[2 * num_tokens : 2 * num_tokens + num_sampled],
        sampled=[r for (r, _), s in zip(batch, sampling) if s],
        common=common,
        num_tokens=num_tokens,
    )
