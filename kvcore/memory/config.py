"""What the planner produces: groups of layers, tensors over one allocation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvcore._validate import attrs_non_negative, attrs_positive
from kvcore.memory.layout import KVCacheLayout
from kvcore.specs import KVCacheSpec, UniformTypeKVCacheSpecs


def _layer_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"layer names must be a sequence of str, got {value!r}")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {name!r} in {list(names)}")
    return names


def _layer_name_list(value: Any) -> list[str]:
    return list(_layer_names(value))


def _instances_of(cls: type) -> Any:
    def check(inst: Any, attribute: Any, value: list[Any]) -> None:
        for item in value:
            if not isinstance(item, cls):
                raise TypeError(
                    f"{type(inst).__name__}.{attribute.name} must hold {cls.__name__} "
                    f"objects, got {item!r}"
                )

    return check


def _check_layers(inst: Any, attribute: Any, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError(f"{type(inst).__name__}.{attribute.name} must name at least one layer")
    if len(set(value)) != len(value):
        raise ValueError(f"{type(inst).__name__}.{attribute.name} repeats a layer: {list(value)}")


@attrs.frozen
class KVCacheTensor:
    """Layers that share one strided tensor inside the backing allocation.

    Layer ``l`` (its index in ``layers``) of block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride`` of the allocation, whose
    size is ``size`` bytes.
    """

    size: int = attrs.field(validator=attrs_positive)
    layers: tuple[str, ...] = attrs.field(converter=_layer_names, validator=_check_layers)
    layer_stride: int = attrs.field(validator=attrs_non_negative)
    block_stride: int = attrs.field(validator=attrs_positive)
    offset: int = attrs.field(default=0, validator=attrs_non_negative)


def _check_spec(inst: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, KVCacheSpec):
        raise TypeError(f"{type(inst).__name__}.{attribute.name} must be a KVCacheSpec, got {value!r}")


@attrs.define
class KVCacheGroupSpec:
    """Layers that share one block table (and so one spec)."""

    layer_names: list[str] = attrs.field(converter=_layer_name_list, validator=_check_layers)
    kv_cache_spec: KVCacheSpec = attrs.field(validator=_check_spec)

    def spec_of(self, layer_name: str) -> KVCacheSpec:
        """The spec of one layer (the per-layer spec for uniform-type groups)."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.kv_cache_specs[layer_name]
        return spec


@attrs.define
class KVCacheConfig:
    """A planned KV cache: ``num_blocks`` blocks shared by all groups.

    All tensors have the same ``size`` and live in one allocation; groups
    overlay each other from byte 0, and a block id belongs to one group at a
    time.
    """

    num_blocks: int = attrs.field(validator=attrs_positive)
    kv_cache_tensors: list[KVCacheTensor] = attrs.field(
        converter=list, validator=_instances_of(KVCacheTensor)
    )
    kv_cache_groups: list[KVCacheGroupSpec] = attrs.field(
        converter=list, validator=_instances_of(KVCacheGroupSpec)
    )
    layout: KVCacheLayout = attrs.field(default=KVCacheLayout.LBNHC, converter=KVCacheLayout.parse)

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks addressed through ``tensor`` (every group shares the pool)."""
        if not any(tensor is t or tensor == t for t in self.kv_cache_tensors):
            raise ValueError(f"{tensor!r} is not one of this config's tensors")
        return self.num_blocks

    def group_of(self, layer_name: str) -> tuple[int, KVCacheGroupSpec]:
        """``(group id, group)`` of a layer."""
        for group_id, group in enumerate(self.kv_cache_groups):
            if layer_name in group.layer_names:
                return group_id, group
        raise ValueError(f"layer {layer_name!r} is in no KV cache group of this config")

    @property
    def layer_names(self) -> list[str]:
        return [name for g in self.kv_cache_groups for name in g.layer_names]
