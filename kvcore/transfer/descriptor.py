"""The KV cache descriptor (``describe``): where every byte of every block lives, as plain,
versioned data that round-trips through JSON (the format: ``docs/kv-descriptor.md``)."""

from __future__ import annotations

import json
from fractions import Fraction

import attrs
import torch

from kvcore.runtime.kv_cache import KVCache
from kvcore.specs import AttentionSpec, KVCacheSpec, MambaSpec
from kvcore.specs.quant import kv_cache_dtype_of
from kvcore.transfer.descriptor_checks import check_bounds, check_fields

#: Format version written by :meth:`KVCacheDescriptor.to_json`; readers refuse others.
DESCRIPTOR_VERSION = 1
_pair = attrs.converters.optional(tuple)


def _built(cls: type):
    """A converter building ``cls`` from a dict (parsed JSON), passing anything else on."""
    return lambda value: cls(**value) if isinstance(value, dict) else value


def _tuple_of(cls: type):
    return lambda items: tuple(map(_built(cls), items))


@attrs.frozen
class Allocation:
    """One backing buffer: ``size`` bytes at address ``base_ptr`` on ``device``."""

    index: int
    device: str
    base_ptr: int
    size: int


@attrs.frozen
class StateSlice:
    """State tensor ``index`` of a state cache: bytes ``[start, end)`` of a block's content."""

    index: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str
    start: int
    end: int


@attrs.frozen
class ContentMap:
    """What the content bytes C of one (head, state) row hold: ``kind`` ``"attention"`` (K's
    and V's byte ranges in C, None when the spec overrides the content size), ``"state"``
    (each state tensor's range) or ``"raw"``."""

    kind: str
    content_bytes: int
    num_kv_heads: int = 0
    num_head_slots: int = 0
    head_size: int = 0
    head_size_v: int = 0
    tokens_per_state: tuple[int, int] = attrs.field(default=(1, 1), converter=tuple)
    k_bytes: tuple[int, int] | None = attrs.field(default=None, converter=_pair)
    v_bytes: tuple[int, int] | None = attrs.field(default=None, converter=_pair)
    states: tuple[StateSlice, ...] = attrs.field(default=(), converter=_tuple_of(StateSlice))


@attrs.frozen
class ScaleView:
    """A per-token-head layer's float32 scales: ``[r, h, n, k]`` (``k`` 0: K, 1: V) at byte ``offset + 4 * (r *
    strides[0] + ... + k * strides[3])``, inside the block's page."""

    offset: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    strides: tuple[int, ...] = attrs.field(converter=tuple)

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(4 * s for s in self.strides)


@attrs.frozen
class LayerDescriptor:
    """One layer's view: element ``[r, h, n, c]`` is at byte ``offset + r * byte_strides[0] +
    ... + c * byte_strides[3]``; ``rows_per_block`` rows make one manager block; ``scales``
    (per-token-head caches) where each row's K and V scales are."""

    name: str
    allocation: int
    offset: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    strides: tuple[int, ...] = attrs.field(converter=tuple)
    rows_per_block: int
    manager_block_stride: int
    block_bytes: int
    content: ContentMap = attrs.field(converter=_built(ContentMap))
    scales: ScaleView | None = attrs.field(default=None, converter=_built(ScaleView))

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(s * self.itemsize for s in self.strides)


@attrs.frozen
class GroupDescriptor:
    """One KV cache group: ``layers`` describes its layers with views (``layer_names`` all);
    ``manager_block_stride`` is their common stride in bytes (None when they differ);
    ``num_blocks``: the block ids of a separate state region (None: the descriptor's)."""

    group_id: int
    spec_type: str
    block_size: int
    kernel_block_size: int
    ratio: int
    kernel_block_stride: int
    manager_block_stride: int | None
    layer_names: tuple[str, ...] = attrs.field(converter=tuple)
    layers: tuple[LayerDescriptor, ...] = attrs.field(converter=_tuple_of(LayerDescriptor))
    num_blocks: int | None = None


@attrs.frozen
class KVCacheDescriptor:
    """Everything a connector needs to move blocks of one KV cache (``kv_cache_dtype``: "auto" unquantized)."""

    layout: str
    num_blocks: int
    allocations: tuple[Allocation, ...] = attrs.field(converter=_tuple_of(Allocation))
    groups: tuple[GroupDescriptor, ...] = attrs.field(converter=_tuple_of(GroupDescriptor))
    version: int = DESCRIPTOR_VERSION
    kv_cache_dtype: str = "auto"

    def group(self, group_id: int) -> GroupDescriptor:
        if type(group_id) is not int or not 0 <= group_id < len(self.groups):
            raise ValueError(f"group_id {group_id!r} is not a KV cache group of this descriptor; "
                             f"pass an integer in [0, {len(self.groups)})")
        return self.groups[group_id]

    def num_blocks_of(self, group_id: int) -> int:
        """Block ids of group ``group_id``: its state region's, or the descriptor's."""
        found = self.group(group_id).num_blocks
        return self.num_blocks if found is None else found

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVCacheDescriptor:
        """Parse :meth:`to_json` output, checking every field (the text is not trusted): a
        wrong type raises ``TypeError``, a wrong value or version ``ValueError``."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"from_json needs the str or bytes of to_json(), got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"not a KV cache descriptor (invalid JSON: {exc})") from None
        found = data.get("version") if isinstance(data, dict) else None
        if type(found) is not int or found != DESCRIPTOR_VERSION:
            raise ValueError(f"KV cache descriptor version {found!r} is not supported (this kvcore reads "
                             f"version {DESCRIPTOR_VERSION}); describe the cache with a matching kvcore")
        check_fields(data)
        descriptor = cls(**data)
        check_bounds(descriptor)
        return descriptor


def raw_allocation(kv_cache: KVCache) -> torch.Tensor:
    """The KV cache's one backing allocation as a flat int8 tensor."""
    view = next(iter(kv_cache.kv_caches.values()))
    return torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())


def _content_map(spec: KVCacheSpec) -> ContentMap:
    content = spec.state_content_size_bytes
    if isinstance(spec, MambaSpec):
        states, start = [], 0
        for i, (shape, dtype, nbytes) in enumerate(zip(spec.shapes, spec.dtypes, spec.state_bytes)):
            dtype_name = str(dtype).removeprefix("torch.")
            states.append(StateSlice(i, shape, dtype_name, start, start + nbytes))
            start += nbytes
        return ContentMap("state", content, states=states)
    if not isinstance(spec, AttentionSpec):
        return ContentMap("raw", content)
    k_bytes = v_bytes = None
    if spec.state_content_bytes is None:
        k_end = spec.head_size * spec.dtype.itemsize
        k_bytes = (0, k_end)
        if spec.head_size_v:
            v_bytes = (k_end, k_end + spec.head_size_v * spec.dtype.itemsize)
    tps = Fraction(spec.tokens_per_state)
    return ContentMap("attention", content, spec.num_kv_heads, spec.num_heads, spec.head_size,
                      spec.head_size_v, (tps.numerator, tps.denominator), k_bytes, v_bytes)


def describe(kv_cache: KVCache) -> KVCacheDescriptor:
    """The :class:`KVCacheDescriptor` of ``kv_cache`` (one allocation, every group)."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"describe() needs a kvcore.KVCache, got {type(kv_cache).__name__}")
    config = kv_cache.config
    allocations = []
    if kv_cache.kv_caches:
        raw = raw_allocation(kv_cache)
        allocations.append(Allocation(0, str(raw.device), raw.data_ptr(), raw.numel()))
    base_ptr = allocations[0].base_ptr if allocations else 0
    # NOTE: kv_cache.kernel_block_sizes skips the groups without cache pages.
    kernel_sizes = iter(kv_cache.kernel_block_sizes)
    groups = []
    for group_id, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        own = config.num_state_blocks if config.in_state_region(group_id) else None
        first = group.spec_of(group.layer_names[0])
        kernel_size = next(kernel_sizes) if first.has_cache_pages else first.block_size
        layers = []
        for name in group.layer_names:
            view = kv_cache.kv_caches.get(name)
            if view is None or not group.spec_of(name).has_layer_views:
                continue
            # NOTE: views span the planned blocks (an elastic cache's max); ids go to num_blocks.
            rows, item = view.shape[0] // (own or config.num_blocks), view.element_size()
            layers.append(LayerDescriptor(
                name=name, allocation=0, offset=view.data_ptr() - base_ptr,
                dtype=str(view.dtype).removeprefix("torch."), itemsize=item, shape=view.shape,
                strides=view.stride(), rows_per_block=rows,
                manager_block_stride=view.stride(0) * item * rows,
                block_bytes=rows * view.shape[1] * view.shape[2] * view.shape[3] * item,
                content=_content_map(group.spec_of(name)),
                scales=None if (s := kv_cache.scale_caches.get(name)) is None
                else ScaleView(s.data_ptr() - base_ptr, s.shape, s.stride()),
            ))
        ratio = spec.block_size // kernel_size
        strides = {layer.manager_block_stride for layer in layers}
        kernel_strides = [g.kernel_block_stride for g in kv_cache.attn_groups[group_id]]
        groups.append(GroupDescriptor(
            group_id=group_id, spec_type=type(spec).__name__, block_size=spec.block_size,
            kernel_block_size=kernel_size, ratio=ratio,
            kernel_block_stride=next((s for s in kernel_strides if s), ratio),
            manager_block_stride=strides.pop() if len(strides) == 1 else None,
            layer_names=group.layer_names, layers=layers, num_blocks=own,
        ))
    mode = kv_cache_dtype_of(g.spec_of(n) for g in config.kv_cache_groups for n in g.layer_names)
    return KVCacheDescriptor(kv_cache.layout.name, kv_cache.num_blocks, allocations, groups, kv_cache_dtype=mode)
