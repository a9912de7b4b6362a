"""One step's tokens packed into one row, with each KV cache group's block table and slot mapping
(eager, or padded into the buffers a CUDA graph replays), and the CUDA graphs of decode steps."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvcore.errors import KVCoreError
from kvcore.hf.scheduler import GroupInfo, Request
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.runtime.kv_cache import KVCache

#: Scheduled requests (None: padding) and their token counts, in packed order.
Batch = Sequence[tuple["Request | None", int]]


@attrs.frozen(eq=False)
class Step:
    """Device tensors for one forward pass, and which requests sample a token from it."""

    input_ids: torch.Tensor = attrs.field(repr=False)
    position_ids: torch.Tensor = attrs.field(repr=False)
    #: Column of each sampling request's last token (the ``sampled`` requests first).
    logits_indices: torch.Tensor = attrs.field(repr=False)
    sampled: list[Request] = attrs.field(repr=False)
    common: list[CommonAttentionMetadata] = attrs.field(repr=False)


class StepBuilder:
    """Packs scheduled requests into a :class:`Step` over one engine's block tables."""

    def __init__(self, kv: KVCache, groups: list[GroupInfo], tables: list[np.ndarray]) -> None:
        self.kv, self.groups, self.tables = kv, groups, tables
        #: A padded step's views of the static buffers, by shape (made once, reused every replay).
        self._padded_views: dict[tuple, tuple[tuple, tuple]] = {}
        #: (group, attention group) pairs whose builder plans on the host (``plan_graph_step``).
        self._host_planners = [
            (g, attn_group) for g, attn_groups in enumerate(kv.attn_groups) for attn_group in attn_groups
            if hasattr(attn_group.metadata_builders[0], "plan_graph_step")
        ]

    def build(self, batch: Batch, *, pad_to: int | None = None) -> Step:
        """The step of ``batch``; ``pad_to``: padded to that many requests in the static buffers, with
        full-width tables and ``max_seq_len = max_model_len`` (one shape and address per size).

        A padding request (``None``) reads only the null block and writes nowhere (slot -1).
        """
        entries = [*batch, *[(None, 1)] * ((pad_to or 0) - len(batch))]
        num_reqs = len(entries)
        real = np.array([r is not None for r, _ in entries])
        counts = np.array([n for _, n in entries], dtype=np.int64)
        computed = np.array([r.num_computed if r else 0 for r, _ in entries], dtype=np.int64)
        rows = np.array([r.row if r else 0 for r, _ in entries], dtype=np.int64)
        starts = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        num_tokens = int(starts[-1])
        seq_lens = computed + counts
        owner = np.repeat(np.arange(num_reqs), counts)
        positions = computed[owner] + np.arange(num_tokens) - starts[owner]
        tokens = np.fromiter(
            itertools.chain.from_iterable(r.tokens[r.num_computed : r.num_computed + n] if r else [0] * n
                                          for r, n in entries),
            dtype=np.int64, count=num_tokens,
        )
        sampling = [r is None or r.num_computed + n == r.num_tokens for r, n in entries]
        logits_indices = starts[1:][sampling] - 1
        max_seq_len = self.kv.max_model_len if pad_to else int(seq_lens.max())
        tables, slots = [], []
        for info, table in zip(self.groups, self.tables):
            size = info.block_size
            width = table.shape[1] if pad_to else 1 if info.state else -(-max_seq_len // size)
            rows_table = np.zeros((num_reqs, width), dtype=np.int32)
            held = table[rows[real], :width]  # NOTE: padding rows stay 0 (as wide as their length needs)
            rows_table[real, : held.shape[1]] = held
            column, offset = (0, 0) if info.state else (positions // size, positions % size)
            slot = rows_table[owner, column].astype(np.int64) * size + offset
            tables.append(rows_table)
            slots.append(np.where(real[owner], slot, -1))
        longs = np.concatenate([tokens, positions, logits_indices, *slots])
        ints = np.concatenate([starts, seq_lens, *(t.ravel() for t in tables)]).astype(np.int32)
        shape = (num_reqs, num_tokens, len(logits_indices), tuple(t.shape for t in tables),
                 int(counts.max()), max_seq_len)
        if pad_to is None:
            device = self.kv.device
            long_t, int_t = torch.from_numpy(longs).to(device), torch.from_numpy(ints).to(device)
            input_ids, position_ids, logits_at, common = _unpack(long_t, int_t, *shape)
        else:
            host_long, host_int, long_t, int_t = self._static_buffers
            host_long[: len(longs)] = torch.from_numpy(longs)
            host_int[: len(ints)] = torch.from_numpy(ints)
            long_t[: len(longs)].copy_(host_long[: len(longs)], non_blocking=True)
            int_t[: len(ints)].copy_(host_int[: len(ints)], non_blocking=True)
            if shape not in self._padded_views:
                host = _unpack(host_long, host_int, *shape) if self._host_planners else None
                self._padded_views[shape] = (host, _unpack(long_t, int_t, *shape))
            host, (input_ids, position_ids, logits_at, common) = self._padded_views[shape]
            if host is not None:
                self._plan_on_host(host[3])
        sampled = [r for (r, _), s in zip(entries, sampling) if s and r is not None]
        return Step(input_ids, position_ids, logits_at, sampled, common)

    @functools.cached_property
    def _static_buffers(self) -> tuple[torch.Tensor, ...]:
        """Pinned host and device buffers for the largest padded step (one decode token per row)."""
        batch, device = self.tables[0].shape[0], self.kv.device
        pin = device.type == "cuda"
        host_long = torch.zeros((3 + len(self.tables)) * batch, dtype=torch.int64, pin_memory=pin)
        num_ints = 2 * batch + 1 + sum(batch * t.shape[1] for t in self.tables)
        host_int = torch.zeros(num_ints, dtype=torch.int32, pin_memory=pin)
        return host_long, host_int, host_long.to(device, copy=True), host_int.to(device, copy=True)

    def _plan_on_host(self, common: list[CommonAttentionMetadata]) -> None:
        """Let builders that plan on the host (``plan_graph_step``) plan a padded step from its CPU
        tensors, block tables in kernel blocks, before capture and every replay (no device sync)."""
        for g, attn_group in self._host_planners:
            table = common[g].block_table_tensor
            if attn_group.kernel_block_size is not None:
                ratio = attn_group.blocks_per_manager_block
                step = attn_group.kernel_block_stride or ratio
                table = (table[..., None] * step + torch.arange(ratio, dtype=torch.int32)).flatten(1)
            attn_group.metadata_builders[0].plan_graph_step(
                attrs.evolve(common[g], block_table_tensor=table)
            )


def _unpack(longs: torch.Tensor, ints: torch.Tensor, num_reqs: int, num_tokens: int, num_sampled: int,
            table_shapes: Sequence[tuple[int, int]], max_query_len: int, max_seq_len: int) -> tuple:
    """Views of a packed step: input ids, positions, logits indices, and each group's metadata."""
    query_start_loc, seq_lens = ints[: num_reqs + 1], ints[num_reqs + 1 : 2 * num_reqs + 1]
    long_at, int_at = 2 * num_tokens + num_sampled, 2 * num_reqs + 1
    common = []
    for shape in table_shapes:
        size = shape[0] * shape[1]
        common.append(CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table_tensor=ints[int_at : int_at + size].view(shape),
            slot_mapping=longs[long_at : long_at + num_tokens], num_reqs=num_reqs,
            num_actual_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
        ))
        long_at, int_at = long_at + num_tokens, int_at + size
    return (longs[:num_tokens].unsqueeze(0), longs[num_tokens : 2 * num_tokens].unsqueeze(0),
            longs[2 * num_tokens : 2 * num_tokens + num_sampled], common)


#: Backends whose decode steps are captured by default (no host work inside ``forward`` / ``decode``).
GRAPH_BACKENDS = ("triton", "flashinfer", "triton-mixer")


class DecodeGraphs:
    """An engine's captured decode steps, one per padded batch size (1, 2, 4, 8, multiples of 16,
    ``max_num_seqs``); ``capture=False`` runs the same padded steps eagerly (CPU tests)."""

    def __init__(self, device: torch.device, max_num_seqs: int, *, capture: bool = True) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        self.device, self.capture = device, capture
        sizes = {s for s in (1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)) if s <= max_num_seqs}
        self.sizes = sorted(sizes | {max_num_seqs})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

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
            self.capture_size(size, lambda: forward(step))  # noqa: B023 (called here)

    def run(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The next token of every row of the staged padded step of ``size``: replayed, or ``forward()``."""
        if not self.capture:
            return forward()
        self.graphs[size].replay()
        return self.outputs[size]


def graphs_wanted(option: Any, device: torch.device, backend_names: Sequence[str]) -> bool:
    """``cuda_graphs=None`` (Engine checked its type): on a CUDA device, on when every backend of
    the engine is one of :data:`GRAPH_BACKENDS`."""
    if option is None:
        return device.type == "cuda" and all(name in GRAPH_BACKENDS for name in backend_names)
    if option and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device; the model is on {device}")
    return option



def uncapturable(exc: RuntimeError, *, asked: bool) -> None:
    """After a decode step failed to capture: ``cuda_graphs=True`` is refused, naming why; by default
    the engine warns and runs its decode steps eagerly (the ``None`` it keeps for its graphs)."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if asked:
        raise KVCoreError(f"cuda_graphs=True, but this model's decode step cannot be captured in a CUDA graph "
                          f"({reason}); pass cuda_graphs=False") from exc
    warnings.warn(f"kvcore: decode steps run without CUDA graphs: this model's decode step cannot be captured "
                  f"({reason})", RuntimeWarning, stacklevel=3)
