"""KVCacheDescriptor.from_json checks every field of text from another process.

A descriptor read from JSON is refused (``TypeError`` for a wrong type,
``ValueError`` for a wrong value, naming the field and the value) unless every
byte any block of any layer can address lies inside its allocation; so
``plan_transfer`` on whatever ``from_json`` accepts never leaves an allocation.
"""

from __future__ import annotations

import copy
import json

import pytest
from _transfer_caches import cached_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.transfer import KVCacheDescriptor, describe, plan_transfer


def _valid(kind: str = "uniform", layout: str = "LBNHC") -> dict:
    return json.loads(describe(cached_cache(kind, layout)).to_json())


def _set(data: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


LAYER = ("groups", 0, "layers", 0)

WRONG_TYPES = [
    (("num_blocks",), True),
    (("num_blocks",), "32"),
    (("num_blocks",), 1000.0),
    (("layout",), 5),
    (("allocations",), {"index": 0}),
    (("allocations", 0, "size"), "524288"),
    (("allocations", 0, "base_ptr"), 1.5),
    ((*LAYER, "offset"), None),
    ((*LAYER, "strides"), "1,2,3,4"),
    ((*LAYER, "shape", 1), False),
    (("groups", 0, "ratio"), 1.0),
    ((*LAYER, "content", "content_bytes"), [32]),
]

WRONG_VALUES = [
    (("layout",), "XYZ", "layout"),
    (("num_blocks",), -4, "num_blocks"),
    (("num_blocks",), 1, "num_blocks"),
    (("num_blocks",), 10**6, "shape\\[0\\]"),
    (("num_blocks",), 2**40, "num_blocks"),
    ((*LAYER, "offset"), 10**12, "offset"),
    ((*LAYER, "dtype"), "bogus", "dtype"),
    ((*LAYER, "dtype"), "float32", "itemsize"),  # the cache is float16: itemsize 2 disagrees
    ((*LAYER, "strides"), [64, 32], "strides"),
    ((*LAYER, "shape"), [7, 2, 16], "shape"),
    ((*LAYER, "allocation"), 5, "allocation"),
    ((*LAYER, "allocation"), -1, "allocation"),
    ((*LAYER, "manager_block_stride"), 8, "manager_block_stride"),
    ((*LAYER, "name"), "layers.9.attn", "name"),
    (("groups", 0, "ratio"), 0, "ratio"),
    (("groups", 0, "group_id"), 3, "group_id"),
    (("allocations",), [], "allocations"),
    (("allocations", 0, "size"), 10, "offset"),
    (("allocations", 0, "base_ptr"), -4096, "base_ptr"),
    (("allocations", 0, "index"), 5, "index"),
    (("allocations", 0, "device"), "cuda 0", "device"),
    ((*LAYER, "content", "kind"), "weird", "kind"),
    ((*LAYER, "content", "k_bytes"), [0, 10**6], "k_bytes"),
    ((*LAYER, "content", "num_kv_heads"), 9, "num_kv_heads"),
    ((*LAYER, "rows_per_block"), 0, "rows_per_block"),
    (("version",), True, "version"),
]


@pytest.mark.parametrize("path, value", WRONG_TYPES)
def test_a_wrong_type_is_a_type_error_naming_the_field_and_value(path, value):
    text = json.dumps(_set(_valid(), path, value))
    with pytest.raises(TypeError, match=str(path[-1])) as info:
        KVCacheDescriptor.from_json(text)
    assert repr(value)[:20] in str(info.value)


@pytest.mark.parametrize("path, value, field", WRONG_VALUES)
def test_a_wrong_value_is_a_value_error_naming_the_field(path, value, field):
    with pytest.raises(ValueError, match=field):
        KVCacheDescriptor.from_json(json.dumps(_set(_valid(), path, value)))


def test_missing_and_unknown_fields_are_named():
    data = _valid()
    del data["groups"][0]["layers"][0]["offset"]
    with pytest.raises(ValueError, match="missing \\['offset'\\]"):
        KVCacheDescriptor.from_json(json.dumps(data))
    data = _set(_valid(), ("allocations", 0, "extra"), 1)
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        KVCacheDescriptor.from_json(json.dumps(data))
    with pytest.raises(TypeError, match="str or bytes"):
        KVCacheDescriptor.from_json(None)


def test_an_offset_one_block_too_far_is_refused_and_one_within_accepted():
    data = _valid("uniform", "BLNHC")
    layer = data["groups"][0]["layers"][-1]
    size = data["allocations"][0]["size"]
    # The last layer's last block ends exactly at the end of the allocation: one more byte is outside.
    assert KVCacheDescriptor.from_json(json.dumps(data)).groups[0].layers[-1].offset == layer["offset"]
    too_far = _set(data, ("groups", 0, "layers", len(data["groups"][0]["layers"]) - 1, "offset"),
                   layer["offset"] + 2)
    with pytest.raises(ValueError, match=f"holds {size} bytes"):
        KVCacheDescriptor.from_json(json.dumps(too_far))


# Tampering: replace any int/str/list leaf with a nearby or absurd value, or drop/flip a field.
def _leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list) and node and not all(isinstance(v, (int, float)) for v in node):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    else:
        yield path, node


_VALID = {(kind, layout): _valid(kind, layout)
          for kind, layout in [("uniform", "LBNHC"), ("uniform", "BHLNC"), ("hybrid", "LHBNC"),
                               ("split", "LBHNC"), ("state", "BLNHC")]}


def _tampered_value(value):
    ints = st.integers(-(2**64), 2**64) | st.integers(-3, 3)
    if isinstance(value, bool):
        return st.booleans() | ints
    if isinstance(value, int):
        return (ints | st.integers(-64, 64).map(lambda d: value + d) | st.integers(1, 8).map(lambda k: value * k)
                | st.just(float(value)) | st.just(str(value)) | st.just(True) | st.none())
    if isinstance(value, list):
        return st.lists(ints | st.integers(0, 4096), max_size=5) | st.just(value[:-1]) | st.just([*value, *value])
    return st.sampled_from(["LBNHC", "BLNHC", "bfloat16", "int8", "XYZ", "", "cuda:0"]) | ints | st.none()


@st.composite
def tampered(draw):
    key = draw(st.sampled_from(sorted(_VALID)))
    data = copy.deepcopy(_VALID[key])
    for _ in range(draw(st.integers(1, 3))):
        path, value = draw(st.sampled_from(list(_leaves(data))))
        data = _set(data, path, draw(_tampered_value(value)))
    return data


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tampered(), st.data())
def test_a_plan_from_any_accepted_descriptor_stays_inside_its_allocations(data, draw):
    try:
        desc = KVCacheDescriptor.from_json(json.dumps(data))
    except (TypeError, ValueError):
        return  # refused: nothing is planned from it
    ids = draw.draw(st.lists(st.integers(1, desc.num_blocks - 1), max_size=6)
                    | st.just([desc.num_blocks - 1]))
    for group in desc.groups:
        if not group.layers:
            continue
        for region in plan_transfer(desc, ids, group_id=group.group_id):
            assert region.offset >= 0 and region.length > 0
            assert region.end <= desc.allocations[region.allocation].size


REASONS = [
    ((*LAYER, "manager_block_stride"), 8, "shape and strides give"),
    ((*LAYER, "block_bytes"), 8, "shape and strides give"),
    ((*LAYER, "content", "content_bytes"), 10**6, r"a row of the view holds \d+ bytes"),
    ((*LAYER, "content", "num_kv_heads"), 9, r"the view has \d+ head slots"),
    ((*LAYER, "strides", 1), 0, "needs a positive stride"),
]


@pytest.mark.parametrize("path, value, reason", REASONS)
def test_a_derived_field_that_disagrees_says_why_it_must_agree(path, value, reason):
    with pytest.raises(ValueError, match=reason) as info:
        KVCacheDescriptor.from_json(json.dumps(_set(_valid(), path, value)))
    assert f"is {value!r}" in str(info.value)
    assert "to_json() text unchanged" in str(info.value)
