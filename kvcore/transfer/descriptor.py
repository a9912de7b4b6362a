"""The KV cache descriptor: where every byte of every block lives, as plain data.

A :class:`KVCacheDescriptor` is a frozen, versioned record that round-trips
through JSON, so a transfer engine in another process (or another project)
can read it without importing kvcore. ``docs/kv-descriptor.md`` documents the
format field by field.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from kvcore.transfer.checks import check_bounds, check_fields

#: Format version written by :meth:`KVCacheDescriptor.to_json`; readers refuse others.
DESCRIPTOR_VERSION = 1


def _tuple(value: Any) -> tuple:
    return tuple(value)


def _int_pair(value: Any) -> tuple[int, int] | None:
    return None if value is None else (int(value[0]), int(value[1]))


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
    shape: tuple[int, ...] = attrs.field(converter=_tuple)
    dtype: str
    start: int
    end: int


@attrs.frozen
class ContentMap:
    """What the content bytes C of one (head, state) row hold.

    ``kind`` is ``"attention"`` (``k_bytes`` / ``v_bytes`` are the byte ranges
    of K and V inside C; None when the spec overrides the content size),
    ``"state"`` (``states`` lists each state tensor's byte range) or
    ``"raw"`` (no structure kvcore knows of).
    """

    kind: str
    content_bytes: int
    num_kv_heads: int = 0
    num_head_slots: int = 0
    head_size: int = 0
    head_size_v: int = 0
    tokens_per_state: tuple[int, int] = attrs.field(default=(1, 1), converter=_int_pair)
    k_bytes: tuple[int, int] | None = attrs.field(default=None, converter=_int_pair)
    v_bytes: tuple[int, int] | None = attrs.field(default=None, converter=_int_pair)
    states: tuple[StateSlice, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen
class LayerDescriptor:
    """One layer's view as allocated, and what it holds.

    Element ``[r, h, n, c]`` of the view is at byte ``offset + r * byte_strides[0]
    + h * byte_strides[1] + n * byte_strides[2] + c * byte_strides[3]`` of
    allocation ``allocation``. ``rows_per_block`` view rows make one manager
    block (the kernel split ratio when the view is kernel-addressed, else 1);
    manager block ``b`` starts ``b * manager_block_stride`` bytes after row 0.
    """

    name: str
    allocation: int
    offset: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...] = attrs.field(converter=_tuple)
    strides: tuple[int, ...] = attrs.field(converter=_tuple)
    rows_per_block: int
    manager_block_stride: int
    block_bytes: int
    content: ContentMap

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(s * self.itemsize for s in self.strides)


@attrs.frozen
class GroupDescriptor:
    """One KV cache group: layers sharing one block table.

    ``layers`` describes the layers that have views (``layer_names`` lists
    all, in model order). ``kernel_block_size`` equals ``block_size`` when
    blocks are not split; ``kernel_block_stride`` is the kernel block id
    distance between two manager blocks in the kernel block table.
    ``manager_block_stride`` is the layers' common manager block stride in
    bytes (None when they differ: read it per layer).
    """

    group_id: int
    spec_type: str
    block_size: int
    kernel_block_size: int
    ratio: int
    kernel_block_stride: int
    manager_block_stride: int | None
    layer_names: tuple[str, ...] = attrs.field(converter=_tuple)
    layers: tuple[LayerDescriptor, ...] = attrs.field(converter=_tuple)

    def layer(self, name: str) -> LayerDescriptor:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise ValueError(
            f"group {self.group_id} has no cache view for layer {name!r}; its layers "
            f"with views are {[layer.name for layer in self.layers]}"
        )


@attrs.frozen
class KVCacheDescriptor:
    """Everything a connector needs to move blocks of one KV cache (see docs/kv-descriptor.md)."""

    layout: str
    num_blocks: int
    allocations: tuple[Allocation, ...] = attrs.field(converter=_tuple)
    groups: tuple[GroupDescriptor, ...] = attrs.field(converter=_tuple)
    version: int = DESCRIPTOR_VERSION

    def group(self, group_id: int) -> GroupDescriptor:
        if type(group_id) is not int or not 0 <= group_id < len(self.groups):
            raise ValueError(
                f"group_id {group_id!r} is not a KV cache group of this descriptor; "
                f"pass an integer in [0, {len(self.groups)})"
            )
        return self.groups[group_id]

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVCacheDescriptor:
        """Parse and check :meth:`to_json` output (text from another process is not trusted).

        Every field is checked (:mod:`kvcore.transfer.checks`): a wrong type raises
        ``TypeError``, a wrong value ``ValueError``, each naming the field and the
        value; so does a layer whose blocks would address bytes outside its
        allocation. Malformed JSON or another ``version`` raises ``ValueError``.
        """
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"from_json needs the str or bytes of to_json(), got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"not a KV cache descriptor (invalid JSON: {exc})") from None
        found = data.get("version") if isinstance(data, dict) else None
        if type(found) is not int or found != DESCRIPTOR_VERSION:
            raise ValueError(
                f"KV cache descriptor version {found!r} is not supported (this kvcore reads "
                f"version {DESCRIPTOR_VERSION}); describe the cache with a matching kvcore"
            )
        check_fields(data)
        descriptor = _descriptor(data)
        check_bounds(descriptor)
        return descriptor


def _content(data: dict[str, Any]) -> ContentMap:
    states = tuple(StateSlice(**s) for s in data.pop("states"))
    return ContentMap(states=states, **data)


def _layer(data: dict[str, Any]) -> LayerDescriptor:
    return LayerDescriptor(content=_content(dict(data.pop("content"))), **data)


def _group(data: dict[str, Any]) -> GroupDescriptor:
    return GroupDescriptor(layers=tuple(_layer(dict(layer)) for layer in data.pop("layers")), **data)


def _descriptor(data: dict[str, Any]) -> KVCacheDescriptor:
    data = dict(data)
    allocations = tuple(Allocation(**a) for a in data.pop("allocations"))
    groups = tuple(_group(dict(g)) for g in data.pop("groups"))
    return KVCacheDescriptor(allocations=allocations, groups=groups, **data)
