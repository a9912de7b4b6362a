"""Checks of hook answers: each normalizes a valid answer or raises saying what was expected.

A ``TypeError``/``ValueError`` raised here becomes a
:class:`~kvcore.errors.PluginError` naming the plugin that answered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvcore.memory.layout import KVCacheLayout
from kvcore.plugins.requirements import KernelRequirements
from kvcore.specs import KVCacheSpec, MultipleOf


def check_sizes(value: Any) -> list[int | MultipleOf]:
    """An answer of ``kvcore_supported_kernel_block_sizes``: positive ints and MultipleOf."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of int or MultipleOf, got {value!r}")
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
