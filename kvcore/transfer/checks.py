"""Field-by-field checks of a KV cache descriptor read from JSON (another process's data).

:func:`check_fields` checks the parsed JSON before any object is built: every
field's type (a bool is not an int, ``"32"`` and ``1000.0`` are not ints),
its range, layout and dtype names, shape and stride lengths, allocation
indices. :func:`check_bounds` then proves, for every layer, that every byte
any block ``[0, num_blocks)`` of it can address lies inside its allocation,
so a plan built from the descriptor never leaves the cache. Wrong types raise
``TypeError``, wrong values ``ValueError``; both name the field and the value.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kvcore.memory.layout import KVCacheLayout, block_runs

#: Block ids are int32 in block tables; a descriptor claiming more blocks is not a real cache.
MAX_BLOCKS = 2**31 - 1
#: Byte addresses are 64-bit.
MAX_ADDRESS = 2**64
#: A block split into more runs than this is not a layout kvcore makes.
MAX_RUNS_PER_BLOCK = 1 << 16
_DEVICE = re.compile(r"[a-z_]+(:\d+)?")
_CONTENT_KINDS = ("attention", "state", "raw")
_REMEDY = "; describe the cache with kvcore's describe() and pass its to_json() text unchanged"

_TOP = {"layout", "num_blocks", "allocations", "groups", "version"}
_ALLOCATION = {"index", "device", "base_ptr", "size"}
_GROUP = {"group_id", "spec_type", "block_size", "kernel_block_size", "ratio", "kernel_block_stride",
          "manager_block_stride", "layer_names", "layers"}
_LAYER = {"name", "allocation", "offset", "dtype", "itemsize", "shape", "strides", "rows_per_block",
          "manager_block_stride", "block_bytes", "content"}
_CONTENT = {"kind", "content_bytes", "num_kv_heads", "num_head_slots", "head_size", "head_size_v",
            "tokens_per_state", "k_bytes", "v_bytes", "states"}
_STATE = {"index", "shape", "dtype", "start", "end"}


def _type_error(field: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"descriptor field {field} must be {expected}, got {value!r} ({type(value).__name__}){_REMEDY}")


def _value_error(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"descriptor field {field} is {value!r}: {why}{_REMEDY}")


def _int(field: str, value: Any, low: int = 0, high: int = MAX_ADDRESS - 1) -> int:
    if type(value) is not int:
        raise _type_error(field, value, "an integer")
    if not low <= value <= high:
        raise _value_error(field, value, f"expected an integer in [{low}, {high}]")
    return value


def _str(field: str, value: Any) -> str:
    if type(value) is not str or not value:
        raise _type_error(field, value, "a non-empty string")
    return value


def _list(field: str, value: Any, length: int | None = None) -> list:
    if type(value) is not list:
        raise _type_error(field, value, "a list")
    if length is not None and len(value) != length:
        raise _value_error(field, value, f"expected {length} entries")
    return value


def _obj(field: str, value: Any, keys: set[str], optional: set[str] = frozenset()) -> dict:
    if type(value) is not dict:
        raise _type_error(field, value, "an object")
    missing, extra = keys - optional - value.keys(), value.keys() - keys
    if missing or extra:
        what = f"missing {sorted(missing)}" if missing else f"unknown {sorted(extra)}"
        raise _value_error(field, sorted(value), f"fields {what}")
    return value


def _dtype(field: str, value: Any) -> torch.dtype:
    dtype = getattr(torch, _str(field, value), None)
    if not isinstance(dtype, torch.dtype):
        raise _value_error(field, value, "not a torch dtype name (such as 'bfloat16' or 'float32')")
    return dtype


def _range(field: str, value: Any, size: int) -> None:
    if value is None:
        return
    start, end = (_int(f"{field}[{i}]", v) for i, v in enumerate(_list(field, value, 2)))
    if not start <= end <= size:
        raise _value_error(field, value, f"expected 0 <= start <= end <= content_bytes ({size})")


def _content(at: str, data: Any) -> None:
    data = _obj(at, data, _CONTENT, _CONTENT - {"kind", "content_bytes"})
    if data["kind"] not in _CONTENT_KINDS:
        raise _value_error(f"{at}.kind", data["kind"], f"expected one of {list(_CONTENT_KINDS)}")
    size = _int(f"{at}.content_bytes", data["content_bytes"])
    for key in ("num_kv_heads", "num_head_slots", "head_size", "head_size_v"):
        _int(f"{at}.{key}", data.get(key, 0), 0, 2**31)
    for i, v in enumerate(_list(f"{at}.tokens_per_state", data.get("tokens_per_state", [1, 1]), 2)):
        _int(f"{at}.tokens_per_state[{i}]", v, 1, 2**31)
    _range(f"{at}.k_bytes", data.get("k_bytes"), size)
    _range(f"{at}.v_bytes", data.get("v_bytes"), size)
    for i, state in enumerate(_list(f"{at}.states", data.get("states", []))):
        where = f"{at}.states[{i}]"
        state = _obj(where, state, _STATE)
        _int(f"{where}.index", state["index"], i, i)
        for j, n in enumerate(_list(f"{where}.shape", state["shape"])):
            _int(f"{where}.shape[{j}]", n, 0, 2**31)
        _dtype(f"{where}.dtype", state["dtype"])
        _range(where, [state["start"], state["end"]], size)


def _layer(at: str, data: Any, num_allocations: int, names: list[str]) -> None:
    data = _obj(at, data, _LAYER)
    if _str(f"{at}.name", data["name"]) not in names:
        raise _value_error(f"{at}.name", data["name"], f"not one of the group's layer_names {names}")
    _int(f"{at}.allocation", data["allocation"], 0, num_allocations - 1)
    _int(f"{at}.offset", data["offset"])
    dtype = _dtype(f"{at}.dtype", data["dtype"])
    _int(f"{at}.itemsize", data["itemsize"], dtype.itemsize, dtype.itemsize)
    shape = [_int(f"{at}.shape[{i}]", n, 1, 2**40) for i, n in enumerate(_list(f"{at}.shape", data["shape"], 4))]
    strides = [_int(f"{at}.strides[{i}]", s, 0, 2**62)
               for i, s in enumerate(_list(f"{at}.strides", data["strides"], 4))]
    for i, (n, s) in enumerate(zip(shape, strides)):
        if n > 1 and s == 0:
            raise _value_error(f"{at}.strides[{i}]", s, f"a dim of {n} elements needs a positive stride")
    rows = _int(f"{at}.rows_per_block", data["rows_per_block"], 1, shape[0])
    item = dtype.itemsize
    derived = {"manager_block_stride": strides[0] * item * rows,
               "block_bytes": rows * shape[1] * shape[2] * shape[3] * item}
    for key, expected in derived.items():
        if _int(f"{at}.{key}", data[key]) != expected:
            raise _value_error(f"{at}.{key}", data[key], f"the layer's shape and strides give {expected}")
    _content(f"{at}.content", data["content"])
    content = data["content"]
    if content["content_bytes"] > shape[3] * item:
        raise _value_error(f"{at}.content.content_bytes", content["content_bytes"],
                           f"a row of the view holds {shape[3] * item} bytes")
    if content.get("num_kv_heads", 0) > shape[1]:
        raise _value_error(f"{at}.content.num_kv_heads", content["num_kv_heads"],
                           f"the view has {shape[1]} head slots")


def _group(at: str, data: Any, index: int, num_allocations: int) -> None:
    data = _obj(at, data, _GROUP)
    _int(f"{at}.group_id", data["group_id"], index, index)
    _str(f"{at}.spec_type", data["spec_type"])
    for key in ("block_size", "kernel_block_size", "ratio", "kernel_block_stride"):
        _int(f"{at}.{key}", data[key], 1, 2**31)
    if data["manager_block_stride"] is not None:
        _int(f"{at}.manager_block_stride", data["manager_block_stride"], 1)
    names = [_str(f"{at}.layer_names[{i}]", n) for i, n in enumerate(_list(f"{at}.layer_names", data["layer_names"]))]
    if len(set(names)) != len(names):
        raise _value_error(f"{at}.layer_names", names, "a layer is listed twice")
    layers = _list(f"{at}.layers", data["layers"])
    for i, layer in enumerate(layers):
        _layer(f"{at}.layers[{i}]", layer, num_allocations, names)
    seen = [layer["name"] for layer in layers]
    if len(set(seen)) != len(seen):
        raise _value_error(f"{at}.layers", seen, "a layer is described twice")


def check_fields(data: Any) -> None:
    """Check the parsed JSON of a descriptor (version already checked) field by field."""
    data = _obj("(top level)", data, _TOP)
    if _str("layout", data["layout"]) not in KVCacheLayout.__members__:
        raise _value_error("layout", data["layout"], f"expected one of {list(KVCacheLayout.__members__)}")
    _int("num_blocks", data["num_blocks"], 2, MAX_BLOCKS)
    allocations = _list("allocations", data["allocations"])
    if not allocations:
        raise _value_error("allocations", allocations, "a descriptor needs at least one allocation")
    for i, alloc in enumerate(allocations):
        alloc = _obj(f"allocations[{i}]", alloc, _ALLOCATION)
        _int(f"allocations[{i}].index", alloc["index"], i, i)
        if not _DEVICE.fullmatch(_str(f"allocations[{i}].device", alloc["device"])):
            raise _value_error(f"allocations[{i}].device", alloc["device"], "expected a device such as 'cuda:0'")
        base = _int(f"allocations[{i}].base_ptr", alloc["base_ptr"])
        _int(f"allocations[{i}].size", alloc["size"], 1, MAX_ADDRESS - 1 - base)
    for i, group in enumerate(_list("groups", data["groups"])):
        _group(f"groups[{i}]", group, i, len(allocations))


def check_bounds(descriptor: Any) -> None:
    """Refuse a descriptor in which any block of any layer addresses bytes outside its allocation."""
    rows_total = descriptor.num_blocks
    for group in descriptor.groups:
        for i, layer in enumerate(group.layers):
            at = f"groups[{group.group_id}].layers[{i}] ({layer.name!r})"
            rows = rows_total * layer.rows_per_block
            if rows > layer.shape[0]:
                raise _value_error(
                    f"{at}.shape[0]", layer.shape[0],
                    f"{descriptor.num_blocks} blocks of {layer.rows_per_block} rows need {rows} rows",
                )
            strides = layer.byte_strides
            last = (rows - 1) * strides[0] + sum((n - 1) * s for n, s in zip(layer.shape[1:], strides[1:]))
            end = layer.offset + last + layer.itemsize
            size = descriptor.allocations[layer.allocation].size
            if end > size:
                raise _value_error(
                    f"{at}.offset", layer.offset,
                    f"its blocks reach byte {end} of allocation {layer.allocation}, which holds {size} bytes",
                )
            try:
                block_runs(layer.shape, strides, layer.itemsize, layer.rows_per_block, max_runs=MAX_RUNS_PER_BLOCK)
            except ValueError as exc:
                raise _value_error(f"{at}.strides", list(layer.strides), str(exc)) from None
