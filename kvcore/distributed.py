"""Tensor parallelism: shard KV heads across ranks, and agree (``torch.distributed``) on
one block count and layout so one scheduler block table is valid on every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from kvcore._validate import as_int, positive_int
from kvcore.memory.layout import KVCacheLayout, resolve_kv_cache_layout
from kvcore.specs import AttentionSpec, KVCacheSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

__all__ = ["agree_layout", "agree_num_blocks", "kv_head_range", "shard_spec"]


def _check_rank(tp_rank: Any, tp_size: Any) -> tuple[int, int]:
    tp_size = positive_int("tp_size", tp_size)
    tp_rank = as_int("tp_rank", tp_rank)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is out of range for tp_size={tp_size}; pass a rank in 0..{tp_size - 1}")
    return tp_rank, tp_size


def _per_rank(count: int, tp_size: int, what: str) -> int:
    """How many of ``count`` heads one rank holds: a shard, or 1 when replicated."""
    if count >= tp_size and count % tp_size == 0:
        return count // tp_size
    if count < tp_size and tp_size % count == 0:
        return 1
    raise ValueError(f"{what}={count} cannot be split over tp_size={tp_size}: neither divides the "
                     f"other; pick a tensor-parallel size that divides {count} or is a multiple of it")


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """The global KV head indices rank ``tp_rank`` of ``tp_size`` holds: a contiguous slice, or,
    with fewer heads than ranks, the one head its query heads read (heads replicated)."""
    tp_rank, tp_size = _check_rank(tp_rank, tp_size)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    first = tp_rank * num_kv_heads // tp_size
    return range(first, first + _per_rank(num_kv_heads, tp_size, "num_kv_heads"))


def shard_spec(spec: KVCacheSpec, tp_rank: int, tp_size: int) -> KVCacheSpec:
    """The spec rank ``tp_rank`` of a ``tp_size``-way tensor-parallel group stores.

    Attention specs split ``num_kv_heads`` (and ``num_head_slots``) evenly, or keep 1 per rank
    with fewer heads than ranks (``kv_head_range``); MLA (one latent cache shared by all heads),
    state caches and other specs stay whole; ``UniformTypeKVCacheSpecs`` shard each layer.
    """
    tp_rank, tp_size = _check_rank(tp_rank, tp_size)
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"shard_spec needs a KVCacheSpec, got {spec!r}")
    if isinstance(spec, UniformTypeKVCacheSpecs) and tp_size > 1:
        return UniformTypeKVCacheSpecs(spec.block_size,
                                       {n: shard_spec(s, tp_rank, tp_size) for n, s in spec.kv_cache_specs.items()})
    if tp_size == 1 or isinstance(spec, MLAAttentionSpec) or not isinstance(spec, AttentionSpec):
        return spec
    heads = _per_rank(spec.num_kv_heads, tp_size, "num_kv_heads")
    slots = spec.num_head_slots
    if slots is not None:
        slots = _per_rank(slots, tp_size, "num_head_slots")
    padded = spec.page_size_padded
    if padded is not None:
        # NOTE: scaled by the factor the real page shrinks by when exact, else dropped
        # (the planner re-pads when it unifies this rank's pages).
        real = (heads if slots is None else slots) * spec.num_states * spec.state_content_size_bytes
        scaled, rest = divmod(padded * real, spec.real_page_size_bytes)
        padded = scaled if rest == 0 else None
    return attrs.evolve(spec, num_kv_heads=heads, num_head_slots=slots, page_size_padded=padded)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device(group: Any) -> torch.device:
    """CPU for gloo/MPI groups, the current CUDA device otherwise (NCCL)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"process group backend {backend!r} needs CUDA, which is not "
                         "available; initialize the group with backend='gloo' on CPU-only hosts")
    return torch.device("cuda", torch.cuda.current_device())


def agree_num_blocks(num_blocks: int, group: Any = None) -> int:
    """The smallest ``num_blocks`` of all ranks in ``group`` (all-reduce MIN; NCCL needs the rank's
    current CUDA device set); ``num_blocks`` itself without an initialized process group."""
    num_blocks = as_int("num_blocks", num_blocks)
    if not _initialized():
        return positive_int("num_blocks", num_blocks)
    # NOTE: range checks happen after the collective, so one bad rank cannot
    # leave the others waiting in all_reduce.
    local = torch.tensor([num_blocks], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group)
    agreed = int(local.item())
    if agreed <= 0:
        raise ValueError(f"ranks agreed on {agreed} KV cache blocks (this rank offered {num_blocks}); every rank "
                         "needs a positive block count: give the smallest rank more memory or plan fewer layers")
    return agreed


def _layout_names(supported: Iterable[KVCacheLayout | str] | None) -> list[str] | None:
    if supported is None:
        return None
    if isinstance(supported, (str, KVCacheLayout)):
        raise TypeError(f"supported must be a list of layouts, got the single value {supported!r}; wrap it in a list")
    names = [KVCacheLayout.parse(item).name for item in supported]
    if not names:
        raise ValueError("supported is empty; list at least one KVCacheLayout this rank accepts")
    return names


def _gather_attempt(function: Callable[[], Any], group: Any) -> list[tuple[Any, str | None]]:
    """Every rank's ``(function(), None)``, or ``(None, its error)``: a failure travels through
    the gather too, so every rank raises instead of some waiting in a collective forever."""
    try:
        local = function(), None
    except (TypeError, ValueError) as err:
        local = None, f"{type(err).__name__}: {err}"
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


def agree_layout(supported: Sequence[KVCacheLayout | str] | None, specs: Iterable[KVCacheSpec] = (), group: Any = None,
                 requested: KVCacheLayout | str | None = None) -> KVCacheLayout:
    """One KV cache layout for every rank in ``group``, from every rank's ``supported`` list (most
    preferred first; None: any), all-gathered and resolved once; when they cannot agree every rank
    raises the same ``ValueError`` naming each rank's list."""
    specs, alone = tuple(specs), not _initialized()
    gathered = [(_layout_names(supported), None)] if alone else _gather_attempt(lambda: _layout_names(supported), group)
    bad = [f"rank {r}: {error}" for r, (_, error) in enumerate(gathered) if error is not None]
    if bad:
        raise ValueError("invalid supported layouts on " + "; ".join(bad))
    lists = [names for names, _ in gathered]

    def resolve() -> str:
        return resolve_kv_cache_layout(lists, specs, requested).name

    if alone:  # NOTE: no other rank: its own error, as resolving alone raises it
        return KVCacheLayout[resolve()]
    described = "; ".join(
        f"rank {r} supports " + ("any layout" if names is None else f"[{', '.join(names)}]")
        for r, names in enumerate(lists)
    )
    outcomes = _gather_attempt(resolve, group)
    errors = list(dict.fromkeys(e.rstrip(".") for _, e in outcomes if e is not None))
    if errors:
        failed = [r for r, (_, e) in enumerate(outcomes) if e is not None]
        raise ValueError(f"ranks could not agree on a KV cache layout: {described}. Ranks "
                         f"{failed} could not resolve: {' | '.join(errors)}. Give every rank "
                         "backends that share a layout, or request one layout every rank supports")
    choices = {c for c, _ in outcomes}
    if len(choices) != 1:
        picked = ", ".join(f"rank {r} -> {c}" for r, (c, _) in enumerate(outcomes))
        raise ValueError(f"ranks resolved different KV cache layouts ({picked}) from {described}; give every "
                         "rank the same specs and the same requested layout (argument or KVCORE_KV_CACHE_LAYOUT)")
    return KVCacheLayout[choices.pop()]
