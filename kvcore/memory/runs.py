"""The contiguous byte runs one manager block of a strided layer view occupies.

A view ``[B * rows_per_block, H, N, C]`` puts manager block ``b`` at rows
``[b * rows_per_block, (b + 1) * rows_per_block)``. Its bytes are one innermost
contiguous run, repeated once per combination of the dims that are not part
of that run (separate head groups under LHBNC, heads interleaved with other
layers under BHLNC, kernel blocks of a split manager block). The zeroer's
segment table and transfer plans both start from these runs.
"""

from __future__ import annotations

from collections.abc import Sequence


def block_runs(
    shape: Sequence[int],
    byte_strides: Sequence[int],
    itemsize: int,
    rows_per_block: int = 1,
    *,
    max_runs: int | None = None,
) -> tuple[list[int], int]:
    """Offsets (bytes from block 0's first element) and common length of block 0's runs.

    ``shape`` and ``byte_strides`` describe the view (dim 0: rows), and
    ``rows_per_block`` consecutive rows form one manager block. The runs cover
    every byte of the block exactly once; ``ValueError`` when there would be
    more than ``max_runs`` of them (None: no limit).
    """
    # (extent, byte stride) of every dim inside a manager block; the element is the innermost.
    dims = [(n, s) for n, s in zip(shape[1:], byte_strides[1:]) if n > 1]
    if rows_per_block > 1:
        dims.append((rows_per_block, byte_strides[0]))
    dims.append((itemsize, 1))
    dims.sort(key=lambda d: d[1])
    run, outer = 1, []
    for extent, stride in dims:
        if not outer and stride == run:
            run *= extent
        else:
            outer.append((extent, stride))
    count = 1
    for extent, _ in outer:
        count *= extent
    if max_runs is not None and count > max_runs:
        raise ValueError(
            f"a view of shape {tuple(shape)} and byte strides {tuple(byte_strides)} splits "
            f"into {count} runs per block; store each (head, state) contiguously"
        )
    offsets = [0]
    for extent, stride in outer:
        offsets = [o + i * stride for o in offsets for i in range(extent)]
    return offsets, run
