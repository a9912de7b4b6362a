"""A plan and its backends' answers, turned into one frozen record per KV cache group that every
later stage reads (the hooks are never asked again)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.planner import is_encoder_only
from kvcore.plugins.answers import HookAnswers, key_of, label
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements
from kvcore.specs import KVCacheSpec


@attrs.frozen
class BackendNegotiation:
    """One attention group's backend, layers, spec and kernel blocks.

    ``kernel_block_size``: None when kernel blocks are the manager blocks. ``kernel_block_stride``:
    0 when kernel block ``j`` of manager block ``b`` is ``b * ratio + j`` (dense pages), else the
    kernel pages between two blocks of a packed cache (``b * stride + j``).
    """

    backend: type[AttentionBackend]
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    group_kernel_block_size: int | None
    kernel_block_size: int | None = None
    kernel_block_stride: int = 0
    requirements: KernelRequirements = NO_REQUIREMENTS


@attrs.frozen
class GroupNegotiation:
    """One KV cache group: ``kernel_block_size`` None without pages; ``ratio`` rows of a view as
    allocated per manager block (> 1 only for a dense group split at allocation)."""

    group_id: int
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    kernel_block_size: int | None
    ratio: int
    backends: tuple[BackendNegotiation, ...]


@attrs.frozen
class Negotiation:
    """One :class:`GroupNegotiation` per KV cache group of a plan, in group order."""

    groups: tuple[GroupNegotiation, ...]

    @property
    def kernel_block_sizes(self) -> list[int]:
        return [g.kernel_block_size for g in self.groups if g.kernel_block_size is not None]

    @property
    def allocation_kernel_block_sizes(self) -> list[int | None]:
        return [g.kernel_block_size if g.ratio > 1 else None for g in self.groups]

    def rows_per_block(self) -> dict[str, int]:
        return {
            name: g.ratio
            for g in self.groups
            if g.kernel_block_size is not None and g.kv_cache_spec.has_layer_views
            for name in g.layer_names
        }


def can_split(spec: KVCacheSpec) -> bool:
    return spec.has_layer_views and spec.is_attention and spec.tokens_per_state > 0


def is_packed(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    return any(
        len(t.layers) > 1 and t.block_stride > t.layer_stride
        for t in config.kv_cache_tensors
        if not set(group.layer_names).isdisjoint(t.layers)
    )


def splits_by_backends(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    splittable = not is_encoder_only(group) and can_split(group.spec_of(group.layer_names[0]))
    return splittable and not is_packed(config, group)


def group_kernel_block_size(
    config: KVCacheConfig,
    group_id: int,
    pairs: Sequence[tuple[type[AttentionBackend], KVCacheSpec]],
    answers: HookAnswers,
) -> int | None:
    """The kernel block size of KV cache group ``group_id`` (None: the group has no pages)."""
    group = config.kv_cache_groups[group_id]
    if is_encoder_only(group):
        return None
    if not splits_by_backends(config, group):
        return group.kv_cache_spec.block_size
    return answers.common_block_size(group.kv_cache_spec.block_size, pairs)


def backend_groups(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
    *,
    customize: bool,
) -> list[dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]]]:
    """Per KV cache group, (backend, spec) -> its layers; ``customize``: specs through the hooks
    (False: the config was planned from customized specs)."""
    out = []
    for gid, group in enumerate(config.kv_cache_groups):
        by_key: dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]] = {}
        out.append(by_key)
        if not group.spec_of(group.layer_names[0]).has_layer_views:
            continue  # NOTE: a raw buffer's owner serves it: no backend entries
        for name in group.layer_names:
            spec = group.spec_of(name)
            if name not in layer_backends:
                if spec.is_attention:
                    raise ValueError(
                        f"attention layer {name!r} (KV cache group {gid}) has no backend in "
                        "layer_backends; map every attention layer of the config to a backend"
                    )
                continue
            backend = layer_backends[name]
            spec = answers.customized_spec(backend, spec) if customize else spec
            by_key.setdefault((backend, spec), []).append(name)
    return out


def negotiate(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
) -> Negotiation:
    """One record per KV cache group of ``config`` (planned from customized specs)."""
    records = []
    for gid, by_key in enumerate(backend_groups(config, layer_backends, answers, customize=False)):
        group = config.kv_cache_groups[gid]
        kernel = group_kernel_block_size(config, gid, list(by_key), answers)
        packed = is_packed(config, group)
        entries = []
        for (backend, spec), names in by_key.items():
            own, stride = (kernel if kernel != spec.block_size else None), 0
            if kernel is not None and packed and can_split(spec):
                own = _own_kernel_size(answers, backend, spec, kernel)
                if own is not None:
                    tensor = next(t for t in config.kv_cache_tensors if names[0] in t.layers)
                    stride = packed_kernel_stride(
                        spec, tensor.block_stride, own, label(backend), names
                    )
            req = answers.requirements(backend, spec)
            record = BackendNegotiation(backend, tuple(names), spec, kernel, own, stride, req)
            entries.append(record)
        ratio = 1 if kernel is None or packed else group.kv_cache_spec.block_size // kernel
        if ratio > 1:
            _check_dense_split(group, kernel, answers)
        layers, spec = tuple(group.layer_names), group.kv_cache_spec
        records.append(GroupNegotiation(gid, layers, spec, kernel, ratio, tuple(entries)))
    return Negotiation(tuple(records))


def _check_dense_split(group: KVCacheGroupSpec, kernel: int, answers: HookAnswers) -> None:
    """A padded page cannot be split: say who padded it (not the layout)."""
    spec = group.kv_cache_spec
    if spec.page_size_padded is None or spec.page_size_padded == spec.real_page_size_bytes:
        return
    padder = answers.padded_by.get(key_of(spec))
    who = (
        "the plan padded (to unify page sizes across layer types)"
        if padder is None
        else f"backend {padder!r}'s kvcore_customize_spec padded"
    )
    raise ValueError(
        f"{who} the {spec.real_page_size_bytes}-byte pages of {list(group.layer_names)} to "
        f"{spec.page_size_padded} bytes, and padded pages cannot be split into {kernel}-token "
        f"kernel blocks; use a manager block size of {kernel} tokens"
        + (", or a backend that does not pad pages" if padder is not None else "")
    )


def settle_kernel_block_size(
    record: BackendNegotiation, kernel_block_size: int, answers: Callable[[], HookAnswers]
) -> BackendNegotiation:
    """``record`` in a group of ``kernel_block_size`` (a hand-made record takes its backend's)."""
    kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
    agreed = record.group_kernel_block_size
    if agreed is not None and kernel_block_size != agreed:
        raise ValueError(
            f"attention group of {list(record.layer_names)} was negotiated with kernel block "
            f"size {agreed}, not {kernel_block_size}; pass {agreed} or None"
        )
    if agreed is not None:
        return record
    spec, own = record.kv_cache_spec, None
    if can_split(spec):
        own = _own_kernel_size(answers(), record.backend, spec, kernel_block_size)
    return attrs.evolve(record, group_kernel_block_size=kernel_block_size, kernel_block_size=own)


def _own_kernel_size(
    answers: HookAnswers, backend: type[AttentionBackend], spec: KVCacheSpec, kernel: int
) -> int | None:
    own = answers.common_block_size(kernel, [(backend, spec)])
    return None if own == spec.block_size else own


def packed_kernel_stride(
    spec: KVCacheSpec, block_stride_bytes: int, kernel: int, backend: str, names: Sequence[str]
) -> int:
    """Kernel pages between two manager blocks of a packed cache, else ``ValueError``."""
    rows = spec.get_num_kernel_states(kernel) if spec.tokens_per_state > 1 else 0
    page = rows * spec.state_content_size_bytes
    if spec.tokens_per_state <= 1 or spec.num_heads != 1 or block_stride_bytes % page:
        raise ValueError(
            f"{backend} needs {kernel}-token kernel blocks, which packed {spec.block_size}-token "
            f"blocks of {list(names)} cannot be split into; use a manager block size of {kernel} "
            "or a layer-compact layout such as LBNHC"
        )
    return block_stride_bytes // page


def to_kernel_blocks(view: torch.Tensor, kernel_rows: int, stride: int) -> torch.Tensor:
    """A manager-block view ``[B, H, N, C]`` as ``[pages, H, kernel_rows, C]`` kernel pages."""
    num_pages = (view.shape[0] - 1) * stride + view.shape[-2] // kernel_rows
    return view.as_strided(
        (num_pages, *view.shape[1:-2], kernel_rows, view.shape[-1]),
        (kernel_rows * view.stride(-2), *view.stride()[1:]),
    )


def to_manager_blocks(view: torch.Tensor, rows: int, stride: int, num_blocks: int) -> torch.Tensor:
    """The inverse of :func:`to_kernel_blocks`."""
    return view.as_strided(
        (num_blocks, *view.shape[1:-2], rows, view.shape[-1]),
        (view.stride(0) * stride, *view.stride()[1:]),
    )
