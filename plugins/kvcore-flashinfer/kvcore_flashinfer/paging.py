"""FlashInfer's page-table form of a step, built on the host from kvcore's block tables.

FlashInfer reads the pages of request ``i`` as
``indices[indptr[i]:indptr[i + 1]]``, the last of them holding
``last_page_len[i]`` tokens (between 1 and the page size). kvcore hands a
dense ``[requests, width]`` table of kernel block ids padded past each
request's last page; this packs the used columns row by row.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class PageTable:
    """One step's CSR page table (all int32 CPU tensors)."""

    #: ``[R + 1]``: request ``i`` owns ``indices[indptr[i]:indptr[i + 1]]``.
    indptr: torch.Tensor
    #: ``[indptr[-1]]``: kernel block ids, request by request, oldest page first.
    indices: torch.Tensor
    #: ``[R]``: tokens in each request's last page, ``1..page_size`` (0 for an empty request).
    last_page_len: torch.Tensor


def page_table(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> PageTable:
    """Pack ``block_table`` (``[R, width]`` kernel block ids) for requests of ``seq_lens`` tokens.

    Runs on the CPU (a device tensor is copied first: a sync; pass host
    tensors on a hot path). ``ValueError`` when a request needs more pages
    than its row holds.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    table = block_table.to("cpu", torch.int32)
    lens = seq_lens.to("cpu", torch.int64)
    if table.dim() != 2 or lens.dim() != 1 or lens.shape[0] > table.shape[0]:
        raise ValueError(
            f"block_table must be [requests, width] and seq_lens [requests], got "
            f"{tuple(table.shape)} and {tuple(lens.shape)}"
        )
    table = table[: lens.shape[0]]
    pages = (lens + page_size - 1) // page_size
    if lens.numel() and int(pages.max()) > table.shape[1]:
        row = int(pages.argmax())
        raise ValueError(
            f"request {row} has {int(lens[row])} tokens ({int(pages[row])} pages of {page_size}) but "
            f"its block table row holds {table.shape[1]} blocks"
        )
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = pages.cumsum(0)
    used = torch.arange(table.shape[1]) < pages[:, None]
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, 0).to(torch.int32)
    return PageTable(indptr, table[used], last)
