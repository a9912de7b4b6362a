"""What the planner produces: groups of layers, tensors over one allocation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvcore._validate import as_int, attrs_non_negative, attrs_positive, positive_int
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

    # ------------------------------------------------------------ capacity
    #
    # A sequence of T tokens takes, in every group that keeps a cache,
    # ``spec.max_num_blocks_per_req(T)`` blocks: ceil(T / block_size) for
    # attention (no sliding-window discount), one for a state cache. Block 0
    # is the null block, so ``num_blocks - 1`` blocks are usable.

    @property
    def usable_blocks(self) -> int:
        """Blocks a scheduler can hand out: all but the null block 0."""
        return self.num_blocks - 1

    def _check_group_id(self, group_id: int) -> KVCacheGroupSpec:
        group_id = as_int("group_id", group_id)
        if not 0 <= group_id < len(self.kv_cache_groups):
            raise ValueError(
                f"group_id={group_id} is out of range; this config has "
                f"{len(self.kv_cache_groups)} KV cache groups (ids 0..{len(self.kv_cache_groups) - 1})"
            )
        return self.kv_cache_groups[group_id]

    def is_state_group(self, group_id: int) -> bool:
        """Whether group ``group_id`` keeps one block per sequence whatever its length.

        True for state caches (``MambaSpec``); False for attention groups,
        whose blocks grow with the tokens, and for encoder-only groups.
        """
        spec = self._check_group_id(group_id).kv_cache_spec
        return spec.has_cache_pages and not _grows_with_tokens(spec)

    def blocks_per_sequence(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens takes over all groups.

        Each attention group rounds up to whole blocks of its own block size;
        each state group takes one block; encoder-only groups take none.
        """
        num_tokens = positive_int("num_tokens", num_tokens)
        return sum(
            spec.max_num_blocks_per_req(num_tokens)
            for spec in (g.kv_cache_spec for g in self.kv_cache_groups)
            if spec.has_cache_pages
        )

    def sequence_capacity(self, num_tokens: int) -> int:
        """Sequences of ``num_tokens`` tokens each that fit in the pool at once.

        For a state-only model (e.g. all Mamba layers) this does not depend on
        ``num_tokens``: one block per state group and sequence. 0 when the
        config keeps no cache at all (encoder-only models).
        """
        needed = self.blocks_per_sequence(num_tokens)
        return self.usable_blocks // needed if needed else 0

    @property
    def token_capacity(self) -> int:
        """Tokens one sequence can hold with every group keeping all its blocks.

        The largest ``T`` with ``blocks_per_sequence(T) <= num_blocks - 1``:
        the null block is excluded, each attention group rounds up to whole
        blocks, each state group needs one block, and sliding windows get no
        discount (a model with windows may hold more). Never more than really
        fits: 0 when no sequence fits at all (one block per group is more
        than the usable blocks; say, two state groups in a pool of 2 blocks).
        Also 0 when no group's blocks grow with the tokens (state-only or
        encoder-only models), where a length says nothing:
        :meth:`sequence_capacity` tells how many sequences of any length fit,
        0 when not even one does.
        """
        growing = [
            g.kv_cache_spec.block_size
            for g in self.kv_cache_groups
            if g.kv_cache_spec.has_cache_pages and _grows_with_tokens(g.kv_cache_spec)
        ]
        usable = self.usable_blocks
        if not growing or self.blocks_per_sequence(1) > usable:
            return 0
        # NOTE: T = usable * max(block sizes) + 1 overflows the group with the
        # largest blocks on its own, so the answer lies in [1, that bound).
        lo, hi = 1, usable * max(growing)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_per_sequence(mid) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def group_token_capacity(self, group_id: int) -> int:
        """Tokens one sequence can hold in attention group ``group_id`` alone.

        That group keeping every usable block: ``(num_blocks - 1) *
        block_size``. An upper bound for that group; the model as a whole holds
        :attr:`token_capacity` (at most the smallest of these). A state group
        holds a sequence of any length in one block, and an encoder-only group
        keeps no cache, so both raise ``ValueError`` (see :meth:`is_state_group`
        and :meth:`sequence_capacity`).
        """
        spec = self._check_group_id(group_id).kv_cache_spec
        if not spec.has_cache_pages:
            raise ValueError(
                f"group {group_id} ({type(spec).__name__}) keeps no KV cache, so it has no "
                "token capacity; ask token_capacity for the whole model"
            )
        if not _grows_with_tokens(spec):
            raise ValueError(
                f"group {group_id} ({type(spec).__name__}) is a state cache: it keeps one "
                "block per sequence whatever the sequence's length, so it has no token "
                "capacity; use sequence_capacity(num_tokens) for how many sequences fit "
                "(check is_state_group(group_id) first)"
            )
        return self.usable_blocks * spec.block_size


def _grows_with_tokens(spec: KVCacheSpec) -> bool:
    """Whether a sequence needs more blocks of ``spec`` as it grows (attention, not state)."""
    return spec.max_num_blocks_per_req(spec.block_size + 1) > 1
