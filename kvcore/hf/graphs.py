"""CUDA graphs of decode steps: one per padded batch size, captured up front (Engine.warmup) or on first use.

A decode step (every request computes exactly its last token) has shapes that
depend only on the number of requests, so it is captured once per bucket of
batch sizes (all of them when the engine is built: ``Engine.warmup``) and replayed: model forward, kernel-block table mapping, K/V
writes, attention and the greedy argmax, with no Python in between. Inputs
live in two static device buffers (int64: token ids, positions, slots; int32:
query offsets, sequence lengths, block tables), refreshed from pinned host
buffers by one copy each per step. Padding requests read the null block and
write nowhere (slot -1). The captured metadata states ``max_seq_len =
max_model_len``, so one graph serves every sequence length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.runtime.kv_cache import KVCache
from kvcore.hf.attention_interface import STEP_KWARG, LayerBinding, StepContext
from kvcore.hf.requests import Request


#: Backends whose decode steps are captured by default (no host work inside ``forward``).
GRAPH_BACKENDS = ("triton", "flashinfer")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16, and ``max_num_seqs``."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode steps of one engine (CUDA only)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        layers: Mapping[torch.nn.Module, LayerBinding],
        table_widths: list[int],
        block_sizes: list[int],
        *,
        max_num_seqs: int,
        capture: bool = True,
    ) -> None:
        if capture and kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {kv.device}")
        # NOTE: capture=False runs the same padded static step eagerly (CPU tests of this path).
        self.capture = capture
        self.model, self.kv, self.layers = model, kv, layers
        self.sizes = bucket_sizes(max_num_seqs)
        self.block_sizes = block_sizes
        b = self.max_batch = self.sizes[-1]
        groups = len(block_sizes)
        # Layout of the packed buffers, each field sized for the largest bucket.
        self._long = {"ids": (0, b), "pos": (b, 2 * b)}
        self._long.update({f"slots{g}": ((2 + g) * b, (3 + g) * b) for g in range(groups)})
        self._int = {"qsl": (0, b + 1), "lens": (b + 1, 2 * b + 1)}
        offset = 2 * b + 1
        for g, width in enumerate(table_widths):
            self._int[f"table{g}"] = (offset, offset + b * width)
            offset += b * width
        self.widths = table_widths
        self.host_long = torch.zeros((2 + groups) * b, dtype=torch.int64, pin_memory=capture)
        self.host_int = torch.zeros(offset, dtype=torch.int32, pin_memory=capture)
        self.dev_long = torch.zeros_like(self.host_long, device=kv.device)
        self.dev_int = torch.zeros_like(self.host_int, device=kv.device)
        self._np_long, self._np_int = self.host_long.numpy(), self.host_int.numpy()
        self._np_int[slice(*self._int["qsl"])] = np.arange(b + 1)  # decode: request i owns token i
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, num_reqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_reqs`` requests (None if too many)."""
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def _field(self, name: str) -> np.ndarray:
        if name in self._long:
            return self._np_long[slice(*self._long[name])]
        return self._np_int[slice(*self._int[name])]

    def _dev(self, name: str, size: int) -> torch.Tensor:
        if name in self._long:
            start, _ = self._long[name]
            return self.dev_long[start : start + size]
        start, _ = self._int[name]
        if name.startswith("table"):
            width = self.widths[int(name[5:])]
            return self.dev_int[start : start + size * width].view(size, width)
        return self.dev_int[start : start + size + (name == "qsl")]

    def _fill(self, batch: list[tuple[Request, int]], tables: list[np.ndarray], size: int) -> None:
        """Write ``batch`` (padded to ``size`` requests) into the pinned buffers."""
        n = len(batch)
        positions = np.fromiter((r.num_computed for r, _ in batch), dtype=np.int64, count=n)
        rows = np.fromiter((r.row for r, _ in batch), dtype=np.int64, count=n)
        ids, pos, lens = self._field("ids"), self._field("pos"), self._field("lens")
        ids[:n] = [r.tokens[-1] for r, _ in batch]
        pos[:n] = positions
        lens[:n] = positions + 1
        ids[n:size], pos[n:size], lens[n:size] = 0, 0, 1
        for g, (table, block_size) in enumerate(zip(tables, self.block_sizes)):
            rows_table = self._field(f"table{g}").reshape(self.max_batch, self.widths[g])
            rows_table[:n] = table[rows, : self.widths[g]]
            rows_table[n:size] = 0
            slots = self._field(f"slots{g}")
            slots[:n] = rows_table[np.arange(n), positions // block_size] * block_size + positions % block_size
            slots[n:size] = -1

    def _forward(self, size: int) -> torch.Tensor:
        kv = self.kv
        common = [
            CommonAttentionMetadata(
                query_start_loc=self._dev("qsl", size), seq_lens=self._dev("lens", size),
                block_table_tensor=self._dev(f"table{g}", size), slot_mapping=self._dev(f"slots{g}", size),
                num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=kv.max_model_len,
            )
            for g in range(len(self.block_sizes))
        ]
        step = StepContext(self.layers, kv.build_metadata(common))
        with torch.inference_mode():
            out = self.model(
                input_ids=self._dev("ids", size).unsqueeze(0), position_ids=self._dev("pos", size).unsqueeze(0),
                use_cache=False, **{STEP_KWARG: step},
            )
            return out.logits[0].argmax(-1)

    def _plan_host(self, size: int) -> None:
        """Let metadata builders that plan on the host (``plan_graph_step``) plan this step's inputs.

        They get the step padded to ``size`` as CPU tensors, block tables in kernel
        blocks, before capture and before every replay (no device sync).
        """
        qsl, lens = torch.from_numpy(self._field("qsl")[: size + 1]), torch.from_numpy(self._field("lens")[:size])
        for g, groups in enumerate(self.kv.attn_groups):
            table = torch.from_numpy(self._field(f"table{g}").reshape(self.max_batch, self.widths[g])[:size])
            for attn_group in groups:
                builder = attn_group.metadata_builders[0]
                if not hasattr(builder, "plan_graph_step"):
                    continue
                kernel_table = table
                if attn_group.kernel_block_size is not None:
                    ratio = attn_group.blocks_per_manager_block
                    step = attn_group.kernel_block_stride or ratio
                    kernel_table = (table[..., None] * step + torch.arange(ratio, dtype=torch.int32)).flatten(1)
                builder.plan_graph_step(CommonAttentionMetadata(
                    query_start_loc=qsl, seq_lens=lens, block_table_tensor=kernel_table,
                    slot_mapping=torch.from_numpy(self._field(f"slots{g}")[:size]), num_reqs=size,
                    num_actual_tokens=size, max_query_len=1, max_seq_len=self.kv.max_model_len,
                ))

    def capture_size(self, size: int) -> None:
        """Capture the step of batch size ``size`` (one of ``sizes``) now, if not yet captured."""
        if self.capture and size not in self.graphs:
            self._capture(size, None)

    def _capture(self, size: int, tables: list[np.ndarray] | None) -> None:
        if tables is None:  # NOTE: padding rows read no table
            tables = [np.zeros((1, width), dtype=np.int32) for width in self.widths]
        self._fill([], tables, size)  # padding only: the warm-up runs write nothing
        self._copy()
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles kernels, settles the allocator
                self._forward(size)
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        self._plan_host(size)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = graph
        torch.cuda.synchronize(self.kv.device)  # NOTE: the pinned buffers are refilled next

    def _copy(self) -> None:
        self.dev_long.copy_(self.host_long, non_blocking=True)
        self.dev_int.copy_(self.host_int, non_blocking=True)

    def prepare(self, batch: list[tuple[Request, int]], tables: list[np.ndarray]) -> int:
        """Capture the bucket of ``batch`` if needed and stage its inputs; returns the bucket."""
        size = self.bucket(len(batch))
        if size is None:
            raise ValueError(f"{len(batch)} requests exceed the largest captured batch of {self.max_batch}")
        if self.capture and size not in self.graphs:
            self._capture(size, tables)
        self._fill(batch, tables, size)
        self._plan_host(size)
        self._copy()
        return size

    def replay(self, size: int, num_reqs: int) -> torch.Tensor:
        """Run the captured step of ``size``; the next token of each of the first ``num_reqs`` requests."""
        if not self.capture:
            return self._forward(size)[:num_reqs]
        self.graphs[size].replay()
        return self.outputs[size][:num_reqs]


def graphs_wanted(option: Any, device: torch.device, backend_name: str) -> bool:
    """``cuda_graphs=None`` means on for the ``triton`` and ``flashinfer`` backends on a CUDA device."""
    if option is None:
        return device.type == "cuda" and backend_name in GRAPH_BACKENDS
    if not isinstance(option, bool):
        raise TypeError(f"cuda_graphs must be True, False or None, got {option!r}")
    if option and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; the model is on {device}")
    return option
