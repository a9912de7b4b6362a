"""Argument checks: ``TypeError`` for a wrong type, ``ValueError`` for a value out of range,
each naming the argument and the value."""

from __future__ import annotations

import operator
from typing import Any

import attrs


def as_int(name: str, value: Any) -> int:
    """``value`` as a plain ``int``; bools and non-integers are refused."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def positive_int(name: str, value: Any) -> int:
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    value = as_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be zero or positive, got {value}")
    return value


# NOTE: attrs validators, naming the field as ``Class.field``.
def attrs_positive(inst: Any, attribute: Any, value: Any) -> None:
    positive_int(f"{type(inst).__name__}.{attribute.name}", value)


def attrs_non_negative(inst: Any, attribute: Any, value: Any) -> None:
    non_negative_int(f"{type(inst).__name__}.{attribute.name}", value)


attrs_optional_positive = attrs.validators.optional(attrs_positive)
