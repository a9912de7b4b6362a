"""Checks of a KV cache descriptor read from JSON (not trusted): a wrong type (a bool, ``"32"``
or ``1000.0`` is not an int) raises ``TypeError``, a wrong value ``ValueError``, naming both."""

from __future__ import annotations

import re
from typing import Any

import torch

from kvcore.memory.layout import KVCacheLayout, block_runs
from kvcore.specs.quant import KV_CACHE_DTYPES

MAX_ADDRESS = 2**64
#: A block split into more runs than this is not a layout kvcore makes.
MAX_RUNS_PER_BLOCK = 1 << 16
_DEVICE = re.compile(r"[a-z_]+(:\d+)?")
_REMEDY = "; describe the cache with kvcore's describe() and pass its to_json() text unchanged"
_ALLOCATION = {"index", "device", "base_ptr", "size"}
_GROUP = {"group_id", "spec_type", "block_size", "kernel_block_size", "ratio",
          "kernel_block_stride", "manager_block_stride", "layer_names", "layers", "num_blocks"}
_LAYER = {"name", "allocation", "offset", "dtype", "itemsize", "shape", "strides",
          "rows_per_block", "manager_block_stride", "block_bytes", "content", "scales"}
_CONTENT = {"kind", "content_bytes", "num_kv_heads", "num_head_slots", "head_size",
            "head_size_v", "tokens_per_state", "k_bytes", "v_bytes", "states"}


def _value_error(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"descriptor field {field} is {value!r}: {why}{_REMEDY}")


def _typed(field: str, value: Any, kind: type, expected: str) -> Any:
    if type(value) is not kind or (kind is str and not value):
        got = f"{value!r} ({type(value).__name__})"
        raise TypeError(f"descriptor field {field} must be {expected}, got {got}{_REMEDY}")
    return value


def _int(field: str, value: Any, low: int = 0, high: int = MAX_ADDRESS - 1, why: str | None = None) -> int:
    """``value`` checked to be an int in ``[low, high]``; ``why`` says where the bounds come from."""
    if not low <= _typed(field, value, int, "an integer") <= high:
        expected = f"{low}" if low == high else f"an integer in [{low}, {high}]"
        reason = f"expected {expected}" if why is None else f"expected {expected} ({why})"
        raise _value_error(field, value, reason)
    return value


def _str(field: str, value: Any) -> str:
    return _typed(field, value, str, "a non-empty string")


def _list(field: str, value: Any) -> list:
    return _typed(field, value, list, "a list")


def _ints(field: str, value: Any, low: int, high: int, length: int | None = None) -> list[int]:
    if length is not None and len(_list(field, value)) != length:
        raise _value_error(field, value, f"expected {length} entries")
    return [_int(f"{field}[{i}]", v, low, high) for i, v in enumerate(_list(field, value))]


def _obj(field: str, value: Any, keys: set[str], optional: set[str] = frozenset()) -> dict:
    _typed(field, value, dict, "an object")
    missing, extra = keys - optional - value.keys(), value.keys() - keys
    if missing or extra:
        what = f"missing {sorted(missing)}" if missing else f"unknown {sorted(extra)}"
        raise _value_error(field, sorted(value), f"fields {what}")
    return value


def _itemsize(field: str, value: Any) -> int:
    dtype = getattr(torch, _str(field, value), None)
    if not isinstance(dtype, torch.dtype):
        raise _value_error(field, value, "not a torch dtype name (such as 'bfloat16' or 'float32')")
    return dtype.itemsize


def _range(field: str, value: Any, size: int) -> None:
    if value is not None:
        start, end = _ints(field, value, 0, MAX_ADDRESS - 1, 2)
        if not start <= end <= size:
            why = f"expected 0 <= start <= end <= content_bytes ({size})"
            raise _value_error(field, value, why)


def _content(at: str, data: Any, row_bytes: int, head_slots: int) -> None:
    data = _obj(at, data, _CONTENT, _CONTENT - {"kind", "content_bytes"})
    if data["kind"] not in ("attention", "state", "raw"):
        raise _value_error(f"{at}.kind", data["kind"], "expected 'attention', 'state' or 'raw'")
    why = f"a row of the view holds {row_bytes} bytes"
    size = _int(f"{at}.content_bytes", data["content_bytes"], 0, row_bytes, why)
    why = f"the view has {head_slots} head slots"
    _int(f"{at}.num_kv_heads", data.get("num_kv_heads", 0), 0, head_slots, why)
    for key in ("num_head_slots", "head_size", "head_size_v"):
        _int(f"{at}.{key}", data.get(key, 0), 0, 2**31)
    _ints(f"{at}.tokens_per_state", data.get("tokens_per_state", [1, 1]), 1, 2**31, 2)
    _range(f"{at}.k_bytes", data.get("k_bytes"), size)
    _range(f"{at}.v_bytes", data.get("v_bytes"), size)
    for i, state in enumerate(_list(f"{at}.states", data.get("states", []))):
        where = f"{at}.states[{i}]"
        state = _obj(where, state, {"index", "shape", "dtype", "start", "end"})
        _int(f"{where}.index", state["index"], i, i)
        _ints(f"{where}.shape", state["shape"], 0, 2**31)
        _itemsize(f"{where}.dtype", state["dtype"])
        _range(where, [state["start"], state["end"]], size)


def _scales(at: str, data: Any, shape: list[int], block_stride: int) -> None:
    """A per-token-head layer's scales: a (K, V) float32 pair per row of the view, in its blocks."""
    if data is not None:
        data = _obj(at, data, {"offset", "shape", "strides"})
        _int(f"{at}.offset", data["offset"])
        strides, want = _ints(f"{at}.strides", data["strides"], 0, 2**62, 4), [*shape[:3], 2]
        shape = _ints(f"{at}.shape", data["shape"], 1, 2**40, 4)
        if shape != want or strides[0] * 4 != block_stride or strides[3] != 1:
            why = f"expected shape {want}, a block stride of {block_stride} bytes and K, V side by side"
            raise _value_error(at, data, why)


def _layer(at: str, data: Any, num_allocations: int, names: list[str]) -> None:
    data = _obj(at, data, _LAYER, {"scales"})
    if _str(f"{at}.name", data["name"]) not in names:
        why = f"not one of the group's layer_names {names}"
        raise _value_error(f"{at}.name", data["name"], why)
    _int(f"{at}.allocation", data["allocation"], 0, num_allocations - 1)
    _int(f"{at}.offset", data["offset"])
    item = _itemsize(f"{at}.dtype", data["dtype"])
    _int(f"{at}.itemsize", data["itemsize"], item, item)
    shape = _ints(f"{at}.shape", data["shape"], 1, 2**40, 4)
    strides = _ints(f"{at}.strides", data["strides"], 0, 2**62, 4)
    for i, (n, s) in enumerate(zip(shape, strides)):
        if n > 1 and s == 0:
            why = f"a dim of {n} elements needs a positive stride"
            raise _value_error(f"{at}.strides[{i}]", s, why)
    rows = _int(f"{at}.rows_per_block", data["rows_per_block"], 1, shape[0])
    why = "what the layer's shape and strides give"
    stride = strides[0] * item * rows
    _int(f"{at}.manager_block_stride", data["manager_block_stride"], stride, stride, why)
    nbytes = rows * shape[1] * shape[2] * shape[3] * item
    _int(f"{at}.block_bytes", data["block_bytes"], nbytes, nbytes, why)
    _content(f"{at}.content", data["content"], shape[3] * item, shape[1])
    _scales(f"{at}.scales", data.get("scales"), shape, strides[0] * item)


def _group(at: str, data: Any, index: int, num_allocations: int) -> None:
    data = _obj(at, data, _GROUP, {"num_blocks"})
    _int(f"{at}.group_id", data["group_id"], index, index)
    if data.get("num_blocks") is not None:  # NOTE: a separate state region's block ids
        _int(f"{at}.num_blocks", data["num_blocks"], 2, 2**31 - 1)
    _str(f"{at}.spec_type", data["spec_type"])
    for key in ("block_size", "kernel_block_size", "ratio", "kernel_block_stride"):
        _int(f"{at}.{key}", data[key], 1, 2**31)
    if data["manager_block_stride"] is not None:
        _int(f"{at}.manager_block_stride", data["manager_block_stride"], 1)
    names = _list(f"{at}.layer_names", data["layer_names"])
    for i, name in enumerate(names):
        _str(f"{at}.layer_names[{i}]", name)
    layers = _list(f"{at}.layers", data["layers"])
    for i, layer in enumerate(layers):
        _layer(f"{at}.layers[{i}]", layer, num_allocations, names)
    for field, listed in (("layer_names", names), ("layers", [x["name"] for x in layers])):
        if len(set(listed)) != len(listed):
            raise _value_error(f"{at}.{field}", listed, "a layer is listed twice")


def check_fields(data: Any) -> None:
    """Check the parsed JSON of a descriptor (version already checked) field by field."""
    top = {"layout", "num_blocks", "allocations", "groups", "version", "kv_cache_dtype"}
    data = _obj("(top level)", data, top, {"kv_cache_dtype"})
    modes = _str("kv_cache_dtype", data.get("kv_cache_dtype", "auto")).split(",")
    if any(mode not in KV_CACHE_DTYPES for mode in modes):
        raise _value_error("kv_cache_dtype", data["kv_cache_dtype"], f"expected modes of {list(KV_CACHE_DTYPES)}")
    layouts = list(KVCacheLayout.__members__)
    if _str("layout", data["layout"]) not in layouts:
        raise _value_error("layout", data["layout"], f"expected one of {layouts}")
    # NOTE: block ids are int32 in block tables; more blocks is not a real cache.
    _int("num_blocks", data["num_blocks"], 2, 2**31 - 1)
    allocations = _list("allocations", data["allocations"])
    if not allocations:
        raise _value_error("allocations", allocations, "a descriptor needs at least one allocation")
    for i, alloc in enumerate(allocations):
        at = f"allocations[{i}]"
        alloc = _obj(at, alloc, _ALLOCATION)
        _int(f"{at}.index", alloc["index"], i, i)
        if not _DEVICE.fullmatch(_str(f"{at}.device", alloc["device"])):
            why = "expected a device such as 'cuda:0'"
            raise _value_error(f"{at}.device", alloc["device"], why)
        base = _int(f"{at}.base_ptr", alloc["base_ptr"])
        _int(f"{at}.size", alloc["size"], 1, MAX_ADDRESS - 1 - base)
    for i, group in enumerate(_list("groups", data["groups"])):
        _group(f"groups[{i}]", group, i, len(allocations))


def check_bounds(descriptor: Any) -> None:
    """Refuse a descriptor in which a block of a layer addresses bytes outside its allocation."""
    for group in descriptor.groups:
        num_blocks = descriptor.num_blocks_of(group.group_id)
        for i, layer in enumerate(group.layers):
            at = f"groups[{group.group_id}].layers[{i}] ({layer.name!r})"
            rows = num_blocks * layer.rows_per_block
            if rows > layer.shape[0]:
                why = f"{num_blocks} blocks of {layer.rows_per_block} rows need {rows}"
                raise _value_error(f"{at}.shape[0]", layer.shape[0], why)
            strides = layer.byte_strides
            last = sum((n - 1) * s for n, s in zip((rows, *layer.shape[1:]), strides))
            end = layer.offset + last + layer.itemsize
            size = descriptor.allocations[layer.allocation].size
            if end > size:
                why = f"its blocks reach byte {end} of allocation {layer.allocation}, which holds"
                raise _value_error(f"{at}.offset", layer.offset, f"{why} {size} bytes")
            try:
                block_runs(layer.shape, strides, layer.itemsize, layer.rows_per_block, max_runs=MAX_RUNS_PER_BLOCK)
            except ValueError as exc:
                raise _value_error(f"{at}.strides", list(layer.strides), str(exc)) from None
            scales = layer.scales
            if scales is not None:
                last = sum((n - 1) * s for n, s in zip((rows, *scales.shape[1:]), scales.byte_strides))
                if scales.offset + last + 4 > size:
                    why = f"its scales reach byte {scales.offset + last + 4} of a {size}-byte allocation"
                    raise _value_error(f"{at}.scales.offset", scales.offset, why)
