"""Tensor parallelism for HF models: transformers' own plan for the weights (over the whole world,
ranks in order; its loader needs ``accelerate``), kvcore's for the KV cache."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.utils import is_accelerate_available


def tp_group_size(group: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process in ``group`` (the world, ranks in order); ``(0, 1)`` for None."""
    if group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"group={group!r} was given but torch.distributed is not initialized; call torch.distributed."
                         "init_process_group ('gloo' on CPU, 'nccl' on GPUs) first, or pass group=None for one process")
    try:
        ranks = dist.get_process_group_ranks(group)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"group must be a torch.distributed process group such as dist.group.WORLD, got {group!r} ({err})"
        ) from None
    world = dist.get_world_size()
    if list(ranks) != list(range(world)):
        raise ValueError(
            f"group holds ranks {list(ranks)} but transformers shards weights over the whole world of "
            f"{world} ranks in order; pass group=dist.group.WORLD and start one process per tensor-parallel rank"
        )
    return dist.get_rank(group), len(ranks)


def check_splittable(config: Any, tp_size: int) -> None:
    """Refuse a ``tp_size`` that does not divide both the query and the KV heads (transformers,
    unlike ``shard_spec``, never replicates KV heads across ranks)."""
    text = config.get_text_config()
    q_heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    if q_heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {q_heads} query heads and {kv_heads} KV heads; "
            "transformers' tensor-parallel plan needs whole heads on every rank: use a tensor-parallel "
            f"size that divides {q_heads} and {kv_heads}"
        )


def _distributed_config(config: Any, tp_size: int) -> DistributedConfig:
    check_splittable(config, tp_size)
    if not is_accelerate_available():
        raise ImportError("transformers loads tensor-parallel models through accelerate: pip install accelerate")
    value = os.environ.get("LOCAL_RANK")  # NOTE: transformers binds each rank to device LOCAL_RANK
    if value is None or not value.strip().isdigit():
        raise ValueError(f"LOCAL_RANK={value!r}: transformers' tensor-parallel loading reads this process's "
                         "index on its host from LOCAL_RANK (torchrun sets it, with RANK and WORLD_SIZE); set "
                         "it for each process you start yourself, e.g. LOCAL_RANK=<rank> on one host")
    return DistributedConfig(tp_size=tp_size, tp_plan="auto")


def _checksum(model: torch.nn.Module) -> float:
    return sum(float(t.detach().double().sum()) * (i + 1) for i, t in enumerate(model.state_dict().values()))


def shard_model(model: PreTrainedModel, group: Any = None) -> PreTrainedModel:
    """A copy of ``model`` sharded by transformers' tensor-parallel plan (``model`` itself for one rank).

    Every rank of ``group`` passes a model with the same weights (checked with gathered checksums).
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"shard_model needs a transformers PreTrainedModel, got {type(model).__name__}")
    _, tp_size = tp_group_size(group)
    if tp_size == 1:
        return model
    if (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError(f"{type(model).__name__} is already sharded over {model.tp_size} ranks; pass it unsharded")
    # NOTE: local refusals travel through the gather: every rank raises, none waits in a collective.
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
        raise ValueError(f"the ranks' models have different weights (checksums {sums}); build the model "
                         "the same way on every rank (one config, one seed) or load it with load_tp_model")
    sharded = type(model).from_pretrained(
        None, config=model.config, state_dict=model.state_dict(), dtype=model.dtype,
        attn_implementation=model.config._attn_implementation, distributed_config=dist_config,
    )
    sharded.generation_config = copy.deepcopy(model.generation_config)
    return sharded


def load_tp_model(
    path: str | os.PathLike, *, group: Any = None, dtype: torch.dtype | str | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Load a local checkpoint directory on every rank of ``group``, each rank reading its shard."""
    if not os.path.isdir(path):
        raise ValueError(f"model path {str(path)!r} is not a directory; pass a local checkpoint directory")
    _, tp_size = tp_group_size(group)
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    if tp_size > 1:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        kwargs["distributed_config"] = _distributed_config(config, tp_size)
    given = {k: v for k, v in kwargs.items() if v is not None}
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **given)


def resolve_tp(model: Any, group: Any) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` for serving ``model`` over ``group``: a model sharded over N ranks needs N."""
    tp_rank, tp_size = tp_group_size(group)
    model_tp = getattr(model, "tp_size", None) or 1
    if model_tp != tp_size:
        if group is None:
            remedy = "pass group=dist.group.WORLD"
        elif model_tp == 1:
            remedy = "shard it first: kvcore.hf.tp.shard_model(model, group) or load_tp_model(path, group=group)"
        else:
            remedy = f"serve it over the {model_tp} ranks it was sharded for"
        raise ValueError(f"the model's weights are split over {model_tp} rank(s) but the group has {tp_size}; "
                         f"{remedy}")
    if tp_size > 1:
        check_splittable(model.config, tp_size)
    return tp_rank, tp_size
