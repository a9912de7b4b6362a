"""A conformance kit for attention-backend authors: kvcore caches in any layout (``build_cache``),
random paged batches (``make_batch``), a backend's ``forward`` run on one (``run_forward``) and a
dense float64 reference (``dense_reference``)."""

from __future__ import annotations

import functools

import attrs
import torch

from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import plan_kv_cache
from kvcore.memory.views import allocate_kv_cache
from kvcore.plugins.backend import CommonAttentionMetadata
from kvcore.specs import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYOUTS = list(KVCacheLayout)
# NOTE: layouts that keep a (layer, block) page dense, so blocks can be split into kernel blocks.
SPLITTABLE = [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC]


def build_cache(
    layout,
    block_size,
    num_blocks,
    kv_heads,
    head_size,
    dtype,
    *,
    kernel_block_size=None,
    num_layers=2,
    device=DEVICE,
):
    """Allocate a ``num_layers``-layer cache through kvcore; return its kernel-block views."""
    spec = FullAttentionSpec(block_size, kv_heads, head_size, dtype)
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    config = plan_kv_cache(dict.fromkeys(names, spec), layout, num_blocks=num_blocks)
    sizes = None if kernel_block_size is None else [kernel_block_size]
    caches = allocate_kv_cache(config, device, kernel_block_sizes=sizes)
    return [caches[name] for name in names]


@attrs.frozen
class PagedBatch:
    """One step: per-request full K/V, new-token queries and kernel block tables."""

    keys: list  # per request [seq_len, H, D]
    values: list
    query: torch.Tensor  # [T, Hq, D]
    q_lens: list
    seq_lens: list
    manager_table: torch.Tensor  # [R, width] manager block ids
    kernel_table: torch.Tensor  # [R, width * ratio] kernel block ids

    @property
    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0).tolist()], dtype=torch.int32)

    @property
    def seq_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32)

    def slots(self, kernel_block_size: int, new_only: bool) -> torch.Tensor:
        """Slot of every cached (or only every new) token, request by request."""
        out = []
        for i, (seq_len, q_len) in enumerate(zip(self.seq_lens, self.q_lens)):
            positions = range(seq_len - q_len, seq_len) if new_only else range(seq_len - q_len)
            for pos in positions:
                block = int(self.kernel_table[i, pos // kernel_block_size])
                out.append(block * kernel_block_size + pos % kernel_block_size)
        return torch.tensor(out, dtype=torch.int64)

    def metadata(self, size: int, device=None) -> CommonAttentionMetadata:
        """The step's metadata (kernel blocks of ``size`` tokens): its new tokens' rows and slots."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.to(device), seq_lens=self.seq_lens_tensor.to(device),
            slot_mapping=self.slots(size, True).to(device), block_table_tensor=self.kernel_table.to(device),
            num_reqs=len(self.q_lens), num_actual_tokens=sum(self.q_lens), max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens))

    def tokens(self, tensors: list, new_only: bool) -> torch.Tensor:
        parts = [
            t[n - q :] if new_only else t[: n - q]
            for t, n, q in zip(tensors, self.seq_lens, self.q_lens)
        ]
        return torch.cat(parts)


def make_batch(
    gen, seq_lens, q_lens, *, kv_heads, q_heads, head_size, dtype, num_blocks, block_size, ratio=1
):
    """Random K/V/queries; each request gets distinct random manager blocks."""
    width = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)
    manager = perm[: len(seq_lens) * width].view(len(seq_lens), width).to(torch.int32)
    # NOTE: kernel block j of manager block b is b * ratio + j (dense pages).
    kernel = (manager.unsqueeze(-1) * ratio + torch.arange(ratio, dtype=torch.int32)).flatten(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [rnd(n, kv_heads, head_size) for n in seq_lens]
    values = [rnd(n, kv_heads, head_size) for n in seq_lens]
    query = rnd(sum(q_lens), q_heads, head_size)
    return PagedBatch(keys, values, query, list(q_lens), list(seq_lens), manager, kernel)


def dense_reference(batch: PagedBatch, scale: float, sliding_window=None) -> torch.Tensor:
    """Plain softmax attention, one (token, head) at a time, in float64."""
    q_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape[0], q_heads, batch.values[0].shape[-1], dtype=torch.float64)
    row = 0
    for keys, values, q_len, seq_len in zip(batch.keys, batch.values, batch.q_lens, batch.seq_lens):
        group = q_heads // keys.shape[1]
        for r in range(q_len):
            pos = seq_len - q_len + r
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q_heads):
                k = keys[lo : pos + 1, h // group].double()
                v = values[lo : pos + 1, h // group].double()
                weights = torch.softmax(k @ batch.query[row, h].double() * scale, dim=0)
                out[row, h] = weights @ v
            row += 1
    return out


def run_forward(backend, view: torch.Tensor, batch: PagedBatch, *, scale: float, sliding_window=None):
    """``backend.forward`` on ``batch``'s new tokens once its earlier ones are in ``view`` (as earlier steps
    would have written them), with metadata from the backend's own builder; returns the output.
    Called twice, without ``out`` and with a NaN-filled ``out``, which must come back holding it."""
    device, size, head = view.device, view.shape[2], batch.query.shape[-1]
    slots = batch.slots(size, new_only=False).to(device)
    for t, start in ((batch.keys, 0), (batch.values, head)):  # K, then V
        view[slots // size, :, slots % size, start : start + t[0].shape[-1]] = batch.tokens(t, False).to(view)
    spec = FullAttentionSpec(size, batch.keys[0].shape[1], head, view.dtype)
    builder = backend.get_builder_cls()(spec, ["layer"], device, max_num_seqs=len(batch.q_lens),
                                        max_model_len=batch.kernel_table.shape[1] * size)
    new = [t.to(device) for t in (batch.query, batch.tokens(batch.keys, True), batch.tokens(batch.values, True))]
    call = functools.partial(backend.forward, *new, view, builder.build(0, batch.metadata(size, device)),
                             head_size=head, scale=scale, sliding_window=sliding_window)
    result = call()
    out = torch.full((*new[0].shape[:2], new[2].shape[-1]), float("nan"), dtype=new[0].dtype, device=device)
    for name, got in (("forward(...)", result), ("forward(..., out=out)", call(out=out)), ("out", out)):
        if not (isinstance(got, torch.Tensor) and got.shape == out.shape and torch.allclose(got, result)):
            raise AssertionError(f"{backend.__name__}: {name} gave {getattr(got, 'shape', got)!r}, not forward(...)'s "
                                 "output: forward returns the output, and writes it into out when out is given")
    return result
