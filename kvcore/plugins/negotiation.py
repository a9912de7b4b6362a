"""What the negotiation decided, one frozen record per KV cache group and one for the whole cache,
read by every later stage (the hooks are never asked again), and how it explains itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvcore._table import format_ranges
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec
from kvcore.memory.layout import KVCacheLayout
from kvcore.memory.planner import is_encoder_only
from kvcore.memory.views import with_kernel_pages
from kvcore.plugins.answers import HookAnswers, Refused, key_of, label
from kvcore.plugins.backend import AttentionBackend
from kvcore.plugins.requirements import NO_REQUIREMENTS, KernelRequirements, describe_requirements
from kvcore.specs import KVCacheSpec, MultipleOf


@attrs.frozen
class BackendNegotiation:
    """One attention group's backend, layers, spec and kernel blocks. ``kernel_block_size``: None when kernel
    blocks are the manager blocks. ``kernel_block_stride``: 0 when kernel block ``j`` of manager block ``b`` is
    ``b * ratio + j`` (dense pages), else the kernel pages between two blocks of a packed cache (``b * stride + j``)."""

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
    allocated per manager block (> 1 only for a dense group split at allocation); ``why``: the
    rule that decided the kernel block size."""

    group_id: int
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    kernel_block_size: int | None
    ratio: int
    backends: tuple[BackendNegotiation, ...]
    why: str = ""


@attrs.frozen
class Candidate:
    """A layout the negotiation considered, planned once: its plan, records and kernel-rule checks,
    or why it is refused (``refusal``; ``error``, the error to raise, None when a kernel rule
    refused it); ``tried`` False: never planned."""

    layout: KVCacheLayout
    refusal: str | None = None
    tried: bool = True
    error: Exception | None = attrs.field(default=None, eq=False, repr=False)
    config: KVCacheConfig | None = attrs.field(default=None, eq=False, repr=False)
    groups: tuple[GroupNegotiation, ...] = attrs.field(default=(), eq=False, repr=False)
    checks: tuple[object, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen
class Negotiation:
    """Everything one negotiation decided: the layout, the plan, one :class:`GroupNegotiation` per
    KV cache group in group order, each layer's backend, and why (:meth:`explain`)."""

    groups: tuple[GroupNegotiation, ...]
    layout: KVCacheLayout | None = None
    config: KVCacheConfig | None = attrs.field(default=None, repr=False)
    layer_backends: Mapping[str, type[AttentionBackend]] = attrs.field(factory=dict, repr=False)
    #: blocks usable when the cache is made (an elastic cache: those committed, up to the plan's)
    num_blocks: int | None = None
    elastic: bool = False
    device: torch.device | None = None
    max_num_seqs: int = 1
    max_model_len: int = 1
    enable_prefix_caching: bool = False
    candidates: tuple[Candidate, ...] = ()
    layout_rule: str = ""
    #: layer -> how its backend was chosen ("named" or what ``"auto"`` weighed)
    backend_rules: Mapping[str, str] = attrs.field(factory=dict, repr=False)
    #: what each backend's plugin declared for each served spec
    declared: tuple[Declared, ...] = ()

    @property
    def kernel_block_sizes(self) -> list[int]:
        return [g.kernel_block_size for g in self.groups if g.kernel_block_size is not None]

    @property
    def allocation_kernel_block_sizes(self) -> list[int | None]:
        return [g.kernel_block_size if g.ratio > 1 else None for g in self.groups]

    def rows_per_block(self) -> dict[str, int]:
        return {name: g.ratio for g in self.groups
                if g.kernel_block_size is not None and g.kv_cache_spec.has_layer_views for name in g.layer_names}

    def kernel_pages(self) -> dict[str, tuple[int, int]]:
        """Each layer of a packed group: its kernel rows per kernel block and its kernel block stride."""
        return {name: (e.kv_cache_spec.get_num_kernel_states(e.kernel_block_size), e.kernel_block_stride)
                for g in self.groups for e in g.backends if e.kernel_block_stride for name in e.layer_names}

    def kernel_views(self, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The views kernels read, from the views as allocated: a packed group's layers addressed by
        kernel pages (a dense group's views are split at allocation already)."""
        return with_kernel_pages(kv_caches, self.kernel_pages())

    def explain(self) -> str:
        """Why every layer got what it got: backends, declarations, layouts tried, kernel blocks."""
        lines = [f"negotiated on {self.device}: layout {self.layout.name if self.layout else '-'}"]
        by_rule: dict[tuple[str, str], list[str]] = {}
        for name, backend in self.layer_backends.items():
            by_rule.setdefault((label(backend), self.backend_rules.get(name, "")), []).append(name)
        lines.append("backends:")
        lines += [f"  {_layers(names)}: {backend}, {rule}" for (backend, rule), names in by_rule.items()]
        lines.append("declared:")
        lines += [f"  {d}" for d in self.declared] or ["  (no backend)"]
        lines.append(f"layout {self.layout.name if self.layout else '-'}: {self.layout_rule}")
        for c in self.candidates:
            lines.append(f"  {c.layout.name}: " + ("not tried" if not c.tried else c.refusal or "meets every rule"))
        alike: dict[tuple[str, int, int, str], list[int]] = {}
        for g in self.groups:
            key = (type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.block_size, g.why)
            alike.setdefault(key, []).append(g.group_id)
        lines.append("groups:")
        lines += [f"  group{'s' * (len(ids) > 1)} {format_ranges(ids)} ({kind}, {count} layers, {size}-token blocks): "
                  f"{why}" for (kind, count, size, why), ids in alike.items()]
        lines += [f"  group {g.group_id}, {label(e.backend)}: kernel blocks of {e.kernel_block_size} tokens, "
                  f"{e.kernel_block_stride} kernel pages apart" for g in self.groups for e in g.backends
                  if e.kernel_block_stride]
        if self.config is not None:
            elastic = f", {self.num_blocks:,} committed at first" if self.elastic else ""
            lines.append(f"plan: {self.config.num_blocks:,} blocks{elastic}")
        return "\n".join(lines)


def _layers(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} layers ({names[0]} .. {names[-1]})"


@attrs.frozen
class Declared:
    """What a backend's plugin declared for one (served) spec; ``priority`` None when not asked."""

    backend: type[AttentionBackend]
    spec: KVCacheSpec
    sizes: tuple[int | MultipleOf, ...]
    layouts: tuple[KVCacheLayout, ...] | None
    requirements: KernelRequirements
    priority: int | None = None

    @classmethod
    def of(cls, answers: HookAnswers, backend: type, spec: KVCacheSpec, device: torch.device) -> Declared:
        layouts = answers.stated_layouts(backend, spec)
        return cls(backend, spec, tuple(answers.kernel_block_sizes(backend, spec)),
                   None if layouts is None else tuple(layouts), answers.requirements(backend, spec),
                   answers.asked("kvcore_backend_priority", backend, spec, device))

    def __str__(self) -> str:
        sizes = ", ".join(f"multiple of {s.base}" if isinstance(s, MultipleOf) else str(s) for s in self.sizes)
        said = [f"kernel block sizes {sizes}",
                "layouts " + ("any" if self.layouts is None else ", ".join(x.name for x in self.layouts)),
                "requires " + describe_requirements(self.requirements)]
        priority = [] if self.priority is None else [f"priority {self.priority}"]
        return f"{label(self.backend)} for {type(self.spec).__name__}: " + "; ".join(said + priority)


def can_split(spec: KVCacheSpec) -> bool:
    return spec.has_layer_views and spec.is_attention and spec.tokens_per_state > 0


def is_packed(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    return any(len(t.layers) > 1 and t.block_stride > t.layer_stride for t in config.kv_cache_tensors
               if not set(group.layer_names).isdisjoint(t.layers))


def splits_by_backends(config: KVCacheConfig, group: KVCacheGroupSpec) -> bool:
    splittable = not is_encoder_only(group) and can_split(group.spec_of(group.layer_names[0]))
    return splittable and not is_packed(config, group)


def accepts(sizes: Sequence[int | MultipleOf], block_size: int) -> bool:
    """Whether a backend offering kernel block ``sizes`` takes ``block_size``-token blocks."""
    return any(s.accepts(block_size) if isinstance(s, MultipleOf) else s == block_size for s in sizes)


def common_block_size(answers: HookAnswers, manager: int, pairs: Sequence[tuple[type, Any]]) -> int | Refused:
    """The manager size when every (backend, spec) takes it, else the largest offered int dividing it
    that every one takes, else why there is none."""
    offers = [(label(b), answers.kernel_block_sizes(b, s)) for b, s in pairs]
    ints = {s for _, ss in offers for s in ss if not isinstance(s, MultipleOf) and manager % s == 0}
    for size in [manager, *sorted(ints, reverse=True)]:
        if all(accepts(ss, size) for _, ss in offers):
            return size
    offered = "; ".join(f"{name}: {ss}" for name, ss in offers)
    return Refused(f"No common block size for {manager} ({offered}). Use a manager block size that every "
                   "backend accepts or divides into a size they all accept.")


def group_kernel_block_size(config: KVCacheConfig, group_id: int, pairs: Sequence[tuple[type, KVCacheSpec]],
                            answers: HookAnswers) -> tuple[int | None | Refused, str]:
    """The kernel block size of KV cache group ``group_id`` (None: no pages) and the rule."""
    group = config.kv_cache_groups[group_id]
    if is_encoder_only(group):
        return None, "keeps no cache"
    manager = group.kv_cache_spec.block_size
    if not splits_by_backends(config, group):
        what = "packed blocks" if is_packed(config, group) else "blocks that do not split"
        return manager, f"{what} keep the manager block size"
    size = common_block_size(answers, manager, pairs)
    if isinstance(size, Refused):
        return size, ""
    rule = "every backend takes the manager block size" if size == manager else (
        f"the largest size every backend takes that divides {manager}")
    return size, f"kernel blocks of {size} tokens: {rule}"


def backend_groups(config: KVCacheConfig, layer_backends: Mapping[str, type],
                   serve: Callable[[type, KVCacheSpec], KVCacheSpec] | None = None) -> list[dict[tuple, list[str]]]:
    """Per KV cache group, (backend, spec) -> its layers; ``serve``: the spec a backend stores for
    a layer's (None: the config was planned from the specs the backends store)."""
    out: list[dict[tuple, list[str]]] = []
    for gid, group in enumerate(config.kv_cache_groups):
        out.append(by_key := {})
        if not group.spec_of(group.layer_names[0]).has_layer_views:
            continue  # NOTE: a raw buffer's owner serves it: no backend entries
        for name in group.layer_names:
            spec = group.spec_of(name)
            if name not in layer_backends:
                if spec.is_attention:
                    raise ValueError(f"attention layer {name!r} (KV cache group {gid}) has no backend in "
                                     "layer_backends; map every attention layer of the config to a backend")
                continue
            backend = layer_backends[name]
            by_key.setdefault((backend, spec if serve is None else serve(backend, spec)), []).append(name)
    return out


def group_records(config: KVCacheConfig, layer_backends: Mapping[str, type[AttentionBackend]],
                  answers: HookAnswers) -> tuple[GroupNegotiation, ...] | Refused:
    """One record per KV cache group of ``config`` (planned from customized specs), or why not."""
    records = []
    for gid, by_key in enumerate(backend_groups(config, layer_backends)):
        group = config.kv_cache_groups[gid]
        kernel, why = group_kernel_block_size(config, gid, list(by_key), answers)
        if isinstance(kernel, Refused):
            return kernel
        packed = is_packed(config, group)
        entries = []
        for (backend, spec), names in by_key.items():
            own, stride = (kernel if kernel != spec.block_size else None), 0
            if kernel is not None and packed and can_split(spec):
                own = common_block_size(answers, kernel, [(backend, spec)])
                if isinstance(own, Refused):
                    return own
                own = None if own == spec.block_size else own
                if own is not None:
                    tensor = next(t for t in config.kv_cache_tensors if names[0] in t.layers)
                    stride = packed_stride(spec, tensor.block_stride, own)
                    if stride is None:
                        return Refused(cannot_split(label(backend), spec, own, names))
            entries.append(BackendNegotiation(backend, tuple(names), spec, kernel, own, stride,
                                              answers.requirements(backend, spec)))
        ratio = 1 if kernel is None or packed else group.kv_cache_spec.block_size // kernel
        refusal = _dense_split_refusal(group, kernel, answers) if ratio > 1 else None
        if refusal is not None:
            return refusal
        records.append(GroupNegotiation(gid, tuple(group.layer_names), group.kv_cache_spec, kernel, ratio,
                                        tuple(entries), why))
    return tuple(records)


def _dense_split_refusal(group: KVCacheGroupSpec, kernel: int, answers: HookAnswers) -> Refused | None:
    """A padded page cannot be split: say who padded it (not the layout)."""
    spec = group.kv_cache_spec
    if spec.page_size_padded is None or spec.page_size_padded == spec.real_page_size_bytes:
        return None
    padder = answers.padded_by.get(key_of(spec))
    who = ("the plan padded (to unify page sizes across layer types)" if padder is None
           else f"backend {padder!r}'s kvcore_customize_spec padded")
    return Refused(f"{who} the {spec.real_page_size_bytes}-byte pages of {list(group.layer_names)} to "
                   f"{spec.page_size_padded} bytes, and padded pages cannot be split into {kernel}-token kernel "
                   f"blocks; use a manager block size of {kernel} tokens"
                   + (", or a backend that does not pad pages" if padder is not None else ""))


def packed_stride(spec: KVCacheSpec, block_stride_bytes: int, kernel: int) -> int | None:
    """Kernel pages between two manager blocks of a packed cache (None: its blocks cannot split)."""
    if spec.tokens_per_state <= 1 or spec.num_heads != 1:
        return None
    page = spec.get_num_kernel_states(kernel) * spec.state_content_size_bytes
    return None if block_stride_bytes % page else block_stride_bytes // page


def cannot_split(backend: str, spec: KVCacheSpec, kernel: int, names: Sequence[str]) -> str:
    return (f"{backend} needs {kernel}-token kernel blocks, which packed {spec.block_size}-token blocks of "
            f"{list(names)} cannot be split into; use a manager block size of {kernel} or a layer-compact layout "
            "such as LBNHC")
