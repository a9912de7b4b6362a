"""Negotiation: the one place where ``KVCache.create`` asks the backend hooks.

:class:`~kvcore.plugins.answers.HookAnswers` asks each hook at most once per
distinct (backend, spec) and keeps the answer. :func:`negotiate` turns a
plan and those answers into one frozen :class:`~kvcore.plugins.records.GroupNegotiation` per KV cache
group — backends, the customized spec, the kernel block size, the split
ratio of the views as allocated and each backend's kernel block stride —
which the allocator, attention groups, metadata builders and zeroer then
read instead of asking again. The public helpers of :mod:`kvcore.plugins.block_sizes` and
:mod:`kvcore.plugins.layouts` are thin one-shot wrappers over the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from kvcore._validate import positive_int
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.plan_groups import is_encoder_only
from kvcore.plugins.answers import ALL_LAYOUTS, HookAnswers, key_of, label
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.kernel_views import packed_kernel_stride
from kvcore.plugins.records import BackendNegotiation, GroupNegotiation, Negotiation
from kvcore.plugins.selection import pick_common_block_size
from kvcore.specs import KVCacheSpec


def can_split(spec: KVCacheSpec) -> bool:
    """Whether manager blocks of ``spec`` may be split into kernel blocks.

    Only attention pages whose state count grows with the block size can; a
    spec storing one state per block (``tokens_per_state <= 0``) keeps whole blocks.
    """
    return spec.has_layer_views and spec.is_attention and spec.tokens_per_state > 0


def is_packed(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    """Whether a group's tensor interleaves other layers' pages between its blocks."""
    names = set(group.layer_names)
    return any(
        len(t.layers) > 1 and t.block_stride > t.layer_stride
        for t in config.kv_cache_tensors
        if not names.isdisjoint(t.layers)
    )


def splits_by_backends(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    """Whether a group's kernel block size is chosen by its backends.

    Groups without pages, state caches, one-state-per-block specs and packed
    groups keep their manager block size (packed groups' backends may still
    map their own kernel tables).
    """
    return (
        not is_encoder_only(group)
        and can_split(group.spec_of(group.layer_names[0]))
        and not is_packed(config, group)
    )


def group_kernel_block_size(
    config: KVCacheConfig,
    group_id: int,
    pairs: Sequence[tuple[type[AttentionBackend], KVCacheSpec]],
    answers: HookAnswers,
) -> int | None:
    """The kernel block size of KV cache group ``group_id`` (None: the group has no pages)."""
    group = config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    if is_encoder_only(group):
        return None
    if not splits_by_backends(config, group):
        return spec.block_size
    offers = [(label(b), answers.kernel_block_sizes(b, s)) for b, s in pairs]
    return pick_common_block_size(spec.block_size, offers)


def _check_dense_split(config: KVCacheConfig, group: KVCacheGroupSpec, kernel: int, answers: HookAnswers) -> None:
    """A padded page cannot be split into kernel blocks: say who padded it (not the layout)."""
    spec = group.kv_cache_spec
    if spec.page_size_padded is None or spec.page_size_padded == spec.real_page_size_bytes:
        return
    padder = answers.padded_by.get(key_of(spec))
    who = (
        f"backend {padder!r}'s kvcore_customize_spec padded" if padder is not None
        else "the plan padded (to unify page sizes across layer types)"
    )
    raise ValueError(
        f"{who} the {spec.real_page_size_bytes}-byte pages of {list(group.layer_names)} to "
        f"{spec.page_size_padded} bytes, and padded pages cannot be split into {kernel}-token "
        f"kernel blocks; use a manager block size of {kernel} tokens"
        + (", or a backend that does not pad pages" if padder is not None else "")
    )


def backend_groups(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
    *,
    customize: bool,
) -> list[dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]]]:
    """Per KV cache group, (backend, spec) -> its layers, in config order.

    ``customize=True`` customizes each layer's spec through the hooks;
    False when the config was planned from customized specs. Attention layers
    need a backend; state-cache layers without one are left out, and groups
    without layer views get none.
    """
    out = []
    for gid, group in enumerate(config.kv_cache_groups):
        by_key: dict[tuple[type[AttentionBackend], KVCacheSpec], list[str]] = {}
        if group.spec_of(group.layer_names[0]).has_layer_views:
            for name in group.layer_names:
                layer_spec = group.spec_of(name)
                if name not in layer_backends:
                    if layer_spec.is_attention:
                        raise ValueError(
                            f"attention layer {name!r} (KV cache group {gid}) has no backend in "
                            "layer_backends; map every attention layer of the config to a backend"
                        )
                    continue
                backend = layer_backends[name]
                spec = answers.customized_spec(backend, layer_spec) if customize else layer_spec
                by_key.setdefault((backend, spec), []).append(name)
        out.append(by_key)
    return out


def negotiate(
    config: KVCacheConfig,
    layer_backends: Mapping[str, type[AttentionBackend]],
    answers: HookAnswers,
) -> Negotiation:
    """One record per KV cache group of ``config``, planned from customized specs.

    Each group's kernel block size, the split ratio of its views as
    allocated and each backend's own kernel block size and stride are decided
    here, once; a packed group a backend cannot split raises ``ValueError``
    before anything is allocated.
    """
    records = []
    for gid, by_key in enumerate(backend_groups(config, layer_backends, answers, customize=False)):
        group = config.kv_cache_groups[gid]
        kernel = group_kernel_block_size(config, gid, list(by_key), answers)
        packed = is_packed(config, group)
        entries = []
        for (backend, spec), names in by_key.items():
            own, stride = None, 0
            if kernel is not None and packed and can_split(spec):
                offer = [(label(backend), answers.kernel_block_sizes(backend, spec))]
                own = pick_common_block_size(kernel, offer)
                if own == spec.block_size:
                    own = None
                else:
                    tensor = next(t for t in config.kv_cache_tensors if names[0] in t.layers)
                    stride = packed_kernel_stride(spec, tensor.block_stride, own, label(backend), names)
            elif kernel is not None and kernel != spec.block_size:
                own = kernel
            entries.append(BackendNegotiation(
                backend, tuple(names), spec, kernel, own, stride, answers.requirements(backend, spec)
            ))
        ratio = 1 if kernel is None or packed else group.kv_cache_spec.block_size // kernel
        if ratio > 1:
            _check_dense_split(config, group, kernel, answers)
        records.append(GroupNegotiation(
            gid, tuple(group.layer_names), group.kv_cache_spec, kernel, ratio,
            not is_encoder_only(group), tuple(entries),
        ))
    return Negotiation(tuple(records))


def settle_kernel_block_size(
    record: BackendNegotiation, kernel_block_size: int, answers: Callable[[], HookAnswers]
) -> BackendNegotiation:
    """``record`` for a KV cache group whose kernel block size is ``kernel_block_size``.

    A negotiated record must agree (``ValueError`` otherwise) and is returned
    as is; an unsettled one (a group made by hand) gets the backend's own
    size: the largest it accepts that divides ``kernel_block_size`` (None when
    that is the manager block size, or the spec keeps whole blocks).
    """
    kernel_block_size = positive_int("kernel_block_size", kernel_block_size)
    agreed = record.group_kernel_block_size
    if agreed is not None:
        if kernel_block_size != agreed:
            raise ValueError(
                f"attention group of {list(record.layer_names)} was negotiated with kernel block "
                f"size {agreed}, not {kernel_block_size}; pass {agreed} or None"
            )
        return record
    spec, own = record.kv_cache_spec, None
    if can_split(spec):
        offer = [(label(record.backend), answers().kernel_block_sizes(record.backend, spec))]
        own = pick_common_block_size(kernel_block_size, offer)
        own = None if own == spec.block_size else own
    return attrs.evolve(record, group_kernel_block_size=kernel_block_size, kernel_block_size=own)


__all__ = [
    "ALL_LAYOUTS",
    "BackendNegotiation",
    "GroupNegotiation",
    "HookAnswers",
    "Negotiation",
    "backend_groups",
    "can_split",
    "group_kernel_block_size",
    "is_packed",
    "label",
    "negotiate",
    "settle_kernel_block_size",
    "splits_by_backends",
]
