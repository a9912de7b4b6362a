"""One KV cache group of layers that share a spec type but not a shape."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvcore.specs.base import KVCacheSpec


def _spec_mapping(value: Any) -> dict[str, KVCacheSpec]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"UniformTypeKVCacheSpecs.kv_cache_specs must map layer names to specs, got {value!r}"
        )
    return dict(value)


@attrs.frozen
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One KV cache group of layers of one spec type but different shapes (page: their sum)."""

    kv_cache_specs: dict[str, KVCacheSpec] = attrs.field(converter=_spec_mapping, hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.kv_cache_specs:
            raise ValueError("UniformTypeKVCacheSpecs needs at least one layer spec")
        for name, spec in self.kv_cache_specs.items():
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(
                    f"UniformTypeKVCacheSpecs: layer {name!r} maps to {spec!r}, not a KVCacheSpec"
                )
        kinds = {type(s) for s in self.kv_cache_specs.values()}
        if len(kinds) != 1:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ValueError(f"UniformTypeKVCacheSpecs needs layers of one spec type, got {names}")
        for name, spec in self.kv_cache_specs.items():
            if spec.block_size != self.block_size:
                raise ValueError(
                    f"layer {name!r} has block size {spec.block_size}, the group "
                    f"has {self.block_size}; give every layer the same block size"
                )

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, KVCacheSpec]) -> bool:
        specs = list(kv_cache_specs.values())
        return bool(specs) and all(
            type(s) is type(specs[0]) and s.block_size == specs[0].block_size for s in specs
        )

    @classmethod
    def from_specs(
        cls, kv_cache_specs: Mapping[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """Group ``kv_cache_specs`` when they share one type and block size, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        return cls(next(iter(kv_cache_specs.values())).block_size, kv_cache_specs)

    @property
    def _first(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    tokens_per_state = property(lambda self: self._first.tokens_per_state)
    has_cache_pages = property(lambda self: self._first.has_cache_pages)
    is_attention = property(lambda self: self._first.is_attention)

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def dtype_alignment(self) -> int:
        return math.lcm(*(s.dtype_alignment for s in self.kv_cache_specs.values()))

    def _page_of_tokens(self, tokens: int) -> int:
        return sum(s._page_of_tokens(tokens) for s in self.kv_cache_specs.values())

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        specs = {n: s.copy_with_new_block_size(block_size) for n, s in self.kv_cache_specs.items()}
        return UniformTypeKVCacheSpecs(block_size, specs)

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return max(s.max_num_blocks_per_req(max_model_len) for s in self.kv_cache_specs.values())
