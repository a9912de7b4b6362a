"""Checks of hook answers: each normalizes a valid answer or raises saying what was expected.

A ``TypeError``/``ValueError`` raised here becomes a
:class:`~kvcore.errors.PluginError` naming the plugin that answered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs import KVCacheSpec, MultipleOf


def check_sizes(value: Any) -> list[int | MultipleOf]:
    """An answer of ``kvcore_supported_kernel_block_sizes``: a non-empty list of positive ints and MultipleOf."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of int or MultipleOf, got {value!r}")
    if not value:
        raise ValueError(
            "expected at least one size, got an empty list (return None for a backend the plugin does not own)"
        )
    for size in value:
        if isinstance(size, MultipleOf):
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise TypeError(f"expected positive ints or MultipleOf in the list, got {size!r} in {value!r}")
    return list(value)


def check_spec(value: Any) -> KVCacheSpec:
    """An answer of ``kvcore_customize_spec``: a KVCacheSpec."""
    if not isinstance(value, KVCacheSpec):
        raise TypeError(f"expected a KVCacheSpec, got {value!r}")
    return value


def check_layouts(value: Any) -> list[KVCacheLayout]:
    """An answer of ``kvcore_supported_layouts``: layouts (or names), duplicates dropped."""
    if isinstance(value, (str, KVCacheLayout)) or not isinstance(value, Iterable):
        raise TypeError(f"expected a list of KV cache layouts, got {value!r}")
    out: list[KVCacheLayout] = []
    for item in value:
        layout = KVCacheLayout.parse(item)
        if layout not in out:
            out.append(layout)
    if not out:
        raise ValueError("expected at least one layout (return None to accept any)")
    return out


def check_requirements(value: Any) -> KernelRequirements:
    """An answer of ``kvcore_kernel_requirements``: a KernelRequirements."""
    if not isinstance(value, KernelRequirements):
        raise TypeError(f"expected a kvcore.KernelRequirements, got {value!r}")
    return value


def check_priority(value: Any) -> int:
    """An answer of ``kvcore_backend_priority``: an int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int priority, got {value!r}")
    return int(value)


#: Spec fields a ``kvcore_customize_spec`` answer may change: padding and alignment only.
CUSTOMIZABLE_FIELDS = ("num_head_slots", "page_size_padded", "block_stride_alignment", "state_content_bytes")


def check_customized(original: KVCacheSpec, value: Any, backend: str) -> KVCacheSpec:
    """A customize answer for ``original``: a spec of its class that only pads or aligns it."""
    new = check_spec(value)
    if type(new) is not type(original):
        raise TypeError(
            f"for backend {backend!r} it changed the spec class from {type(original).__name__} "
            f"to {type(new).__name__}; "
            f"a customize hook may only pad or align a spec ({', '.join(CUSTOMIZABLE_FIELDS)})"
        )
    changed = [
        f"{f.name} from {getattr(original, f.name)!r} to {getattr(new, f.name)!r}"
        for f in attrs.fields(type(original))
        if f.name not in CUSTOMIZABLE_FIELDS and getattr(original, f.name) != getattr(new, f.name)
    ]
    if changed:
        raise ValueError(
            f"for backend {backend!r} it changed {'; '.join(changed)}, which changes what the layer "
            "stores; a customize hook "
            f"may only pad or align a spec ({', '.join(CUSTOMIZABLE_FIELDS)}): return "
            "attrs.evolve(spec, num_head_slots=...) or similar, or None"
        )
    return new
