"""Tensor parallelism for HF models: transformers' own plan for the weights, kvcore's for the KV cache.

transformers shards a model's weights itself when it is loaded with a
``DistributedConfig`` (its ``base_model_tp_plan``: query/key/value and MLP-up
projections split by columns, output and MLP-down projections by rows and
all-reduced, logits gathered). Each rank's attention modules then compute
only their shard of the heads, so each rank's KV cache holds only those heads:
the specs of ``specs_from_config`` go through ``kvcore.distributed.shard_spec``,
and ``KVCache.create(..., group=...)`` makes every rank plan one block count in
one layout. Nothing here slices a transformers module by hand.

transformers lays its tensor-parallel mesh over the whole ``torch.distributed``
world, so the group must be the world (``dist.group.WORLD``), ranks in order.
Its loader needs ``accelerate`` installed (``pip install accelerate``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.utils import is_accelerate_available

from kvcore.distributed import shard_spec
from kvcore.specs import KVCacheSpec

__all__ = [
    "check_splittable",
    "load_tp_model",
    "resolve_tp",
    "shard_model",
    "shard_specs",
    "tp_group_size",
]


def tp_group_size(group: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process in ``group``; ``(0, 1)`` for ``group=None``.

    transformers' tensor-parallel mesh spans every rank of the world in rank
    order, so any other group is refused with ``ValueError``.
    """
    if group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"group={group!r} was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group ('gloo' on CPU, 'nccl' on GPUs) first, "
            "or pass group=None for one process"
        )
    try:
        ranks = dist.get_process_group_ranks(group)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"group must be a torch.distributed process group such as dist.group.WORLD, "
            f"got {group!r} ({err})"
        ) from None
    world = dist.get_world_size()
    if list(ranks) != list(range(world)):
        raise ValueError(
            f"group holds ranks {list(ranks)} but transformers shards weights over the "
            f"whole world of {world} ranks in order; pass group=dist.group.WORLD and "
            "start one process per tensor-parallel rank"
        )
    return dist.get_rank(group), len(ranks)


def _heads(config: Any) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    q_heads = int(text.num_attention_heads)
    kv_heads = getattr(text, "num_key_value_heads", None)
    return q_heads, q_heads if kv_heads is None else int(kv_heads)


def check_splittable(config: Any, tp_size: int) -> None:
    """Refuse a tensor-parallel size transformers' plan cannot split this model's heads by.

    The plan splits the key/value projections by columns, so every rank must
    get whole query and KV heads: ``tp_size`` must divide both counts (KV heads
    are never replicated across ranks by transformers, unlike ``shard_spec``).
    """
    q_heads, kv_heads = _heads(config)
    if q_heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {q_heads} query heads and "
            f"{kv_heads} KV heads; transformers' tensor-parallel plan needs whole heads on "
            f"every rank: use a tensor-parallel size that divides {q_heads} and {kv_heads}"
        )


def _distributed_config(config: Any, tp_size: int) -> DistributedConfig:
    check_splittable(config, tp_size)
    if not is_accelerate_available():
        raise ImportError(
            "transformers loads tensor-parallel models through accelerate, which is not "
            "installed: pip install accelerate"
        )
    _check_local_rank()
    return DistributedConfig(tp_size=tp_size, tp_plan="auto")


def _check_local_rank() -> None:
    """transformers' tensor-parallel loading binds each rank to device ``LOCAL_RANK``: it must be set."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or not value.strip().isdigit():
        raise ValueError(
            f"LOCAL_RANK={value!r}: transformers' tensor-parallel loading reads this process's "
            "index on its host from LOCAL_RANK (torchrun sets it, with RANK and WORLD_SIZE); set "
            "it for each process you start yourself, e.g. LOCAL_RANK=<rank> on one host"
        )


def _checksum(model: torch.nn.Module) -> float:
    total = 0.0
    for i, tensor in enumerate(model.state_dict().values()):
        total += float(tensor.detach().double().sum()) * (i + 1)
    return total


def shard_model(model: PreTrainedModel, group: Any = None) -> PreTrainedModel:
    """A copy of ``model`` with its weights sharded by transformers' tensor-parallel plan.

    Every rank of ``group`` passes a model with the same weights (for example
    built from one config under one seed; checked with a checksum gathered from
    all ranks): transformers keeps each rank's shard of them. The copy keeps
    the model's dtype, attention implementation and generation config. With
    ``group=None`` or a group of one rank, ``model`` itself is returned.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"shard_model needs a transformers PreTrainedModel, got {type(model).__name__}")
    _, tp_size = tp_group_size(group)
    if tp_size == 1:
        return model
    if (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError(
            f"{type(model).__name__} is already sharded over {model.tp_size} ranks; "
            "pass the unsharded model"
        )
    # NOTE: local refusals travel through the gather, so every rank raises
    # instead of some ranks waiting in transformers' collectives.
    try:
        dist_config, error = _distributed_config(model.config, tp_size), None
    except (ImportError, ValueError) as err:
        dist_config, error = None, f"{type(err).__name__}: {err}"
    gathered: list[Any] = [None] * tp_size
    dist.all_gather_object(gathered, (_checksum(model), error), group=group)
    errors = list(dict.fromkeys(e for _, e in gathered if e is not None))
    if errors:
        raise ValueError("cannot shard the model over the group: " + " | ".join(errors))
    sums = [s for s, _ in gathered]
    if len(set(sums)) != 1:
        raise ValueError(
            f"the ranks' models have different weights (checksums {sums}); build the model "
            "the same way on every rank (one config, one seed) or load it with load_tp_model"
        )
    sharded = type(model).from_pretrained(
        None,
        config=model.config,
        state_dict=model.state_dict(),
        dtype=model.dtype,
        attn_implementation=model.config._attn_implementation,
        distributed_config=dist_config,
    )
    sharded.generation_config = copy.deepcopy(model.generation_config)
    return sharded


def load_tp_model(
    path: str | os.PathLike,
    *,
    group: Any = None,
    dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a local checkpoint directory on every rank of ``group``, each rank reading its shard.

    ``from_pretrained`` with local files only and transformers' tensor-parallel
    plan (``DistributedConfig``); with ``group=None`` a plain local load.
    """
    if not os.path.isdir(path):
        raise ValueError(f"model path {str(path)!r} is not a directory; pass a local checkpoint directory")
    _, tp_size = tp_group_size(group)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if tp_size > 1:
        kwargs["distributed_config"] = _distributed_config(
            AutoConfig.from_pretrained(path, local_files_only=True), tp_size
        )
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def resolve_tp(model: Any, group: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` for serving ``model`` over ``group``, checked against the model.

    A model whose weights transformers sharded over N ranks must be served
    over a group of N ranks, and a group of more than one rank needs such a
    model (its attention modules compute only their shard of the heads).
    """
    tp_rank, tp_size = tp_group_size(group)
    model_tp = getattr(model, "tp_size", None) or 1
    if model_tp != tp_size:
        if group is None:
            remedy = "pass group=dist.group.WORLD"
        elif model_tp == 1:
            remedy = "shard it first: kvcore.hf.tp.shard_model(model, group) or load_tp_model(path, group=group)"
        else:
            remedy = f"serve it over the {model_tp} ranks it was sharded for"
        raise ValueError(
            f"the model's weights are split over {model_tp} rank(s) but the group has "
            f"{tp_size}; {remedy}"
        )
    if tp_size > 1:
        check_splittable(model.config, tp_size)
    return tp_rank, tp_size


def shard_specs(
    specs: Mapping[str, KVCacheSpec], tp_rank: int, tp_size: int
) -> dict[str, KVCacheSpec]:
    """Each layer's spec as rank ``tp_rank`` of ``tp_size`` stores it (``shard_spec``)."""
    return {name: shard_spec(spec, tp_rank, tp_size) for name, spec in specs.items()}
