"""What the planner produces: groups of layers, tensors over one allocation, and capacity."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import attrs

from kvcore._validate import as_int, attrs_non_negative, attrs_optional_positive, attrs_positive, positive_int
from kvcore.memory.layout import KVCacheLayout
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs

#: Most blocks one cache (its block pool) manages: the pool's host bookkeeping costs about 50
#: bytes a block.
MAX_NUM_BLOCKS = 1 << 26


def _layer_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"layer names must be a sequence of str, got {value!r}")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {name!r} in {list(names)}")
    return names


def _check_layers(inst: Any, attribute: Any, value: tuple[str, ...]) -> None:
    where = f"{type(inst).__name__}.{attribute.name}"
    if not value:
        raise ValueError(f"{where} must name at least one layer")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} repeats a layer: {list(value)}")


def _instances_of(cls: type, *, each: bool = False) -> Any:
    """An attrs validator: the value (``each``: every item of it) is a ``cls``."""

    def check(inst: Any, attribute: Any, value: Any) -> None:
        for item in value if each else [value]:
            if not isinstance(item, cls):
                must = f"hold {cls.__name__} objects" if each else f"be a {cls.__name__}"
                raise TypeError(f"{type(inst).__name__}.{attribute.name} must {must}, got {item!r}")

    return check


@attrs.frozen
class KVCacheTensor:
    """Layers sharing one strided tensor: layer ``l``, block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride`` of the ``size``-byte allocation."""

    size: int = attrs.field(validator=attrs_positive)
    layers: tuple[str, ...] = attrs.field(converter=_layer_names, validator=_check_layers)
    layer_stride: int = attrs.field(validator=attrs_non_negative)
    block_stride: int = attrs.field(validator=attrs_positive)
    offset: int = attrs.field(default=0, validator=attrs_non_negative)


@attrs.define
class KVCacheGroupSpec:
    """Layers that share one block table (and so one spec)."""

    layer_names: list[str] = attrs.field(converter=lambda names: list(_layer_names(names)), validator=_check_layers)
    kv_cache_spec: KVCacheSpec = attrs.field(validator=_instances_of(KVCacheSpec))

    def spec_of(self, layer_name: str) -> KVCacheSpec:
        """The spec of one layer (the per-layer spec for uniform-type groups)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.kv_cache_specs[layer_name]
        return spec


def _grows_with_tokens(spec: KVCacheSpec) -> bool:
    """Whether a sequence needs more blocks of ``spec`` as it grows (attention, not state)."""
    return spec.has_cache_pages and spec.max_num_blocks_per_req(spec.block_size + 1) > 1


def is_state_spec(spec: KVCacheSpec) -> bool:
    """Whether a sequence keeps one block of ``spec`` whatever its length (a state cache)."""
    return spec.has_cache_pages and not _grows_with_tokens(spec)


@attrs.define
class KVCacheConfig:
    """A planned KV cache: ``num_blocks`` blocks shared by all groups, which overlay each other
    from byte 0 of one allocation; a sequence of T tokens takes ``max_num_blocks_per_req(T)``
    blocks in every group that keeps a cache (no sliding-window discount). With ``num_state_blocks``
    (separate state pages) the state groups have a region of their own first, with that many block
    ids; ``num_blocks`` counts the other groups' blocks, after it."""

    num_blocks: int = attrs.field(validator=attrs_positive)
    kv_cache_tensors: list[KVCacheTensor] = attrs.field(converter=list,
                                                        validator=_instances_of(KVCacheTensor, each=True))
    kv_cache_groups: list[KVCacheGroupSpec] = attrs.field(converter=list,
                                                          validator=_instances_of(KVCacheGroupSpec, each=True))
    layout: KVCacheLayout = attrs.field(default=KVCacheLayout.LBNHC, converter=KVCacheLayout.parse)
    num_state_blocks: int | None = attrs.field(default=None, kw_only=True, validator=attrs_optional_positive)

    #: Whether the state groups have a region and block ids of their own.
    separate_state_pages = property(lambda self: self.num_state_blocks is not None)

    def in_state_region(self, group_id: int) -> bool:
        """Whether group ``group_id`` takes its blocks from the separate state region."""
        return self.separate_state_pages and self.is_state_group(group_id)

    def _in_region(self, group: KVCacheGroupSpec) -> bool:  # NOTE: a group of this config: no id to check
        return self.separate_state_pages and is_state_spec(group.kv_cache_spec)

    def state_region_layers(self) -> list[str]:
        """The layers whose groups take their blocks from the separate state region (none without one)."""
        return [n for g in self.kv_cache_groups if self._in_region(g) for n in g.layer_names]

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks addressed through ``tensor`` (its region's: every group of a region shares it)."""
        if tensor not in self.kv_cache_tensors:
            raise ValueError(f"{tensor!r} is not one of this config's tensors")
        if self._in_region(self.group_of(tensor.layers[0])[1]):
            return self.num_state_blocks
        return self.num_blocks

    def group_of(self, layer_name: str) -> tuple[int, KVCacheGroupSpec]:
        """``(group id, group)`` of a layer."""
        for group_id, group in enumerate(self.kv_cache_groups):
            if layer_name in group.layer_names:
                return group_id, group
        raise ValueError(f"layer {layer_name!r} is in no KV cache group of this config")

    layer_names = property(lambda self: [n for g in self.kv_cache_groups for n in g.layer_names])
    #: Each layer's own spec, group by group.
    layer_specs = property(lambda self: {n: g.spec_of(n) for g in self.kv_cache_groups for n in g.layer_names})
    #: Blocks a scheduler can hand out: all but the null block 0.
    usable_blocks = property(lambda self: self.num_blocks - 1)

    def _spec_of_group(self, group_id: int) -> KVCacheSpec:
        group_id, count = as_int("group_id", group_id), len(self.kv_cache_groups)
        if not 0 <= group_id < count:
            raise ValueError(f"group_id={group_id} is out of range; this config "
                             f"has {count} KV cache groups (ids 0..{count - 1})")
        return self.kv_cache_groups[group_id].kv_cache_spec

    def is_state_group(self, group_id: int) -> bool:
        """Whether a group keeps one block per sequence whatever its length (a state cache)."""
        return is_state_spec(self._spec_of_group(group_id))

    def _pooled_specs(self) -> list[KVCacheSpec]:
        """Specs of the groups whose blocks come from the ``num_blocks`` pool."""
        return [g.kv_cache_spec for i, g in enumerate(self.kv_cache_groups) if not self.in_state_region(i)]

    def blocks_per_sequence(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens takes in the ``num_blocks`` pool's groups."""
        num_tokens = positive_int("num_tokens", num_tokens)
        specs = self._pooled_specs()
        return sum(s.max_num_blocks_per_req(num_tokens) for s in specs if s.has_cache_pages)

    def sequence_capacity(self, num_tokens: int) -> int:
        """Sequences of ``num_tokens`` tokens each that fit in the pool (and state slots) at once."""
        needed = self.blocks_per_sequence(num_tokens)
        fit = self.usable_blocks // needed if needed else 0
        slots = sum(map(self.in_state_region, range(len(self.kv_cache_groups))))
        return min(fit, (self.num_state_blocks - 1) // slots) if slots else fit

    @property
    def token_capacity(self) -> int:
        """Tokens one sequence can hold with every group keeping all its blocks (the null block
        excluded, each group rounding up to whole blocks, no sliding-window discount);
        0 when none fits or no group's blocks grow with the tokens (see ``sequence_capacity``)."""
        specs = self._pooled_specs()
        growing = [s.block_size for s in specs if _grows_with_tokens(s)]
        usable = self.usable_blocks
        if not growing or self.blocks_per_sequence(1) > usable:
            return 0
        # NOTE: usable * max(block sizes) + 1 tokens overflow the largest-block group alone.
        tokens = range(1, usable * max(growing) + 1)
        return bisect.bisect_right(tokens, usable, key=self.blocks_per_sequence)

    def group_token_capacity(self, group_id: int) -> int:
        """Tokens one sequence can hold in attention group ``group_id`` alone (an upper bound)."""
        spec = self._spec_of_group(group_id)
        what = f"group {group_id} ({type(spec).__name__})"
        if not spec.has_cache_pages:
            raise ValueError(f"{what} keeps no KV cache, so it has no token "
                             "capacity; ask token_capacity for the whole model")
        if not _grows_with_tokens(spec):
            raise ValueError(f"{what} is a state cache (one block per sequence whatever its length), so it has no "
                             "token capacity; use sequence_capacity(num_tokens) (check is_state_group(group_id) first)")
        return self.usable_blocks * spec.block_size
