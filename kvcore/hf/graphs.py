"""CUDA graphs of decode steps: one per padded batch size, all captured when the engine is built.

A decode step (every request computes exactly its last token), padded to a captured
size by ``StepBuilder.build(batch, pad_to=size)`` (:mod:`kvcore.hf.step`), has one
shape and one address per size, so its whole forward (kernel-block table mapping, K/V
writes, attention, the greedy argmax) is captured once and replayed with no Python in
between. ``capture=False`` runs the same padded steps eagerly (CPU tests of this path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore.hf.step import Step, StepBuilder

#: Backends whose decode steps are captured by default (no host work inside ``forward``).
GRAPH_BACKENDS = ("triton", "flashinfer")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``."""
    sizes = {s for s in (1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)) if s <= max_num_seqs}
    return sorted(sizes | {max_num_seqs})


class DecodeGraphs:
    """The captured decode steps of one engine."""

    def __init__(self, device: torch.device, max_num_seqs: int, *, capture: bool = True) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        self.device, self.capture = device, capture
        self.sizes = bucket_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, num_reqs: int) -> int:
        """The smallest captured batch size that holds ``num_reqs`` requests."""
        return next(size for size in self.sizes if size >= num_reqs)

    def capture_size(self, size: int, forward: Callable[[], torch.Tensor]) -> None:
        """Capture ``forward`` (the padded step of ``size``, staged already) as the graph of ``size``."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles kernels, settles the allocator
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = forward()
        self.graphs[size] = graph
        torch.cuda.synchronize(self.device)  # NOTE: the pinned buffers are refilled next

    def capture_all(
        self, steps: StepBuilder, forward: Callable[[Step], torch.Tensor], *, progress: bool = True
    ) -> None:
        """Capture every size not captured yet, each on a padding-only step that ``steps`` stages."""
        sizes = [s for s in self.sizes if s not in self.graphs]
        if progress and sizes:
            from rich.progress import track

            sizes = track(sizes, description="kvcore: capturing decode CUDA graphs", transient=True)
        for size in sizes:
            step = steps.build([], pad_to=size)
            self.capture_size(size, lambda: forward(step))

    def run(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The next token of every row of the staged padded step of ``size``: replayed, or ``forward()``."""
        if not self.capture:
            return forward()
        self.graphs[size].replay()
        return self.outputs[size]


def graphs_wanted(option: Any, device: torch.device, backend_name: str) -> bool:
    """``cuda_graphs=None`` means on for the ``triton`` and ``flashinfer`` backends on a CUDA device."""
    if option is None:
        return device.type == "cuda" and backend_name in GRAPH_BACKENDS
    if not isinstance(option, bool):
        raise TypeError(f"cuda_graphs must be True, False or None, got {option!r}")
    if option and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; the model is on {device}")
    return option

