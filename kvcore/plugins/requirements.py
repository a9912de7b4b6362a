"""What a backend's kernels need of the memory they read: *ability* rules (device types, dtypes,
head sizes) pick the backend, *memory* rules (stride, alignment) hold every kernel view."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from kvcore._table import format_ranges
from kvcore._validate import attrs_optional_positive, attrs_positive, positive_int
from kvcore.specs.quant import KV_QUANT_DTYPES


def _as_tuple(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, torch.dtype)) or not isinstance(value, Iterable):
        value = (value,)
    return tuple(v.type if isinstance(v, torch.device) and v.index is None else v for v in value)


def _device_type(item: Any) -> None:
    if not isinstance(item, str):
        raise TypeError(f"KernelRequirements.devices must hold device type names such as 'cuda', got {item!r}")
    try:
        valid = torch.device(item).type == item  # NOTE: "cuda:0" has type "cuda"
    except (RuntimeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"KernelRequirements.devices holds {item!r}, which is not a "
                         "torch device type; use names such as 'cuda' or 'cpu' (no index)")


def _dtype(item: Any) -> None:
    if not isinstance(item, torch.dtype):
        raise TypeError(f"KernelRequirements.dtypes must hold torch dtypes, got {item!r}")


def _kv_quant(item: Any) -> None:
    if item not in ("none", *KV_QUANT_DTYPES):
        raise ValueError(f"KernelRequirements.kv_quant holds {item!r}; use 'none', 'per_tensor' or 'per_token_head'")


def _each(check: Callable[[Any], Any]) -> Callable[[Any, Any, Any], None]:
    def validate(inst: Any, attribute: Any, value: tuple[Any, ...] | None) -> None:
        if value is not None and not value:
            raise ValueError(f"KernelRequirements.{attribute.name} is empty; pass None for any")
        for item in value or ():
            check(item)

    return validate


@attrs.frozen(kw_only=True)
class KernelRequirements:
    """The rules a backend's kernels hold the KV cache to (every field optional).

    :param devices: torch device types the kernels run on, e.g. ``("cuda",)``; None: any.
    :param dtypes: cache dtypes the kernels read; None: any.
    :param head_sizes: head sizes the kernels take; None: any.
    :param max_stride_elements: every stride of every kernel view, in elements of the view's
        dtype, must be below this; None: no limit.
    :param alignment_bytes: every stride but the last, in bytes, and every view's byte offset
        in its allocation, must be a multiple of this.
    :param note: a remedy added when the devices rule refuses a case; None: nothing to add.
    :param kv_quant: cache quantizations the kernels read ("none", "per_tensor", "per_token_head"); None: "none".
    """

    devices: tuple[str, ...] | None = attrs.field(default=None, converter=_as_tuple, validator=_each(_device_type))
    dtypes: tuple[torch.dtype, ...] | None = attrs.field(default=None, converter=_as_tuple, validator=_each(_dtype))
    head_sizes: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=_as_tuple,
        validator=_each(lambda item: positive_int("KernelRequirements.head_sizes entry", item)),
    )
    max_stride_elements: int | None = attrs.field(default=None, validator=attrs_optional_positive)
    alignment_bytes: int = attrs.field(default=1, validator=attrs_positive)
    note: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    kv_quant: tuple[str, ...] | None = attrs.field(default=None, converter=_as_tuple, validator=_each(_kv_quant))

    @property
    def has_memory_rules(self) -> bool:
        return self.max_stride_elements is not None or self.alignment_bytes > 1

    def why_not(self, device_type: str | None, dtype: torch.dtype | None, head_size: int | None,
                kv_quant: str | None = None) -> str | None:
        """Why kernels with these requirements cannot serve the case (None: they can)."""
        taken, mode = self.kv_quant or ("none",), kv_quant or "none"
        if mode not in taken:
            return f"takes kv_quant {'/'.join(taken)}, not {mode} (rule: kv_quant)"
        if device_type is not None and self.devices is not None and device_type not in self.devices:
            extra = f"; {self.note}" if self.note else ""
            devices = "/".join(self.devices)
            return f"runs on {devices} only, not {device_type} (rule: devices){extra}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names, got = ", ".join(map(_dtype_name, self.dtypes)), _dtype_name(dtype)
            return f"takes cache dtypes {names}, not {got} (rule: dtypes)"
        sizes = self.head_sizes
        if head_size is not None and sizes is not None and head_size not in sizes:
            return f"takes head sizes [{format_ranges(sorted(set(sizes)))}], not {head_size} (rule: head_sizes)"
        return None

    def view_violation(
        self, strides: Iterable[int], element_size: int, offset_bytes: int
    ) -> tuple[str, int, str] | None:
        """The first memory rule a view breaks, as (rule, value, needed); strides in elements."""
        strides, limit, align = list(strides), self.max_stride_elements, self.alignment_bytes
        too_large = [s for s in strides if limit is not None and s >= limit]
        if too_large:
            return ("max_stride_elements", too_large[0], f"every stride below {limit} elements")
        unaligned = [s * element_size for s in strides[:-1] if (s * element_size) % align]
        if unaligned:
            needed = f"non-last strides in multiples of {align} bytes"
            return ("alignment_bytes", unaligned[0], needed)
        if offset_bytes % align:
            return ("alignment_bytes", offset_bytes, f"view offsets in multiples of {align} bytes")
        return None


#: What a backend whose plugin states nothing is held to.
NO_REQUIREMENTS = KernelRequirements()


def _dtype_name(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def requirements_json(req: KernelRequirements) -> dict[str, Any]:
    """A backend's requirements as JSON values (None: no rule)."""
    return attrs.asdict(req, filter=lambda a, _: a.name != "note", value_serializer=lambda _, __, v: _dtype_name(v))


def describe_requirements(req: KernelRequirements) -> str:
    """One line of what a backend requires ("none" when nothing)."""
    parts = []
    if req.devices is not None:
        parts.append("devices " + ", ".join(req.devices))
    if req.dtypes is not None:
        parts.append("dtypes " + ", ".join(_dtype_name(d) for d in req.dtypes))
    if req.head_sizes is not None:
        parts.append("head sizes " + format_ranges(sorted(set(req.head_sizes))))
    if req.max_stride_elements is not None:
        parts.append(f"strides below {req.max_stride_elements} elements")
    if req.alignment_bytes > 1:
        parts.append(f"{req.alignment_bytes}-byte aligned strides and offsets")
    if req.kv_quant is not None:
        parts.append("kv_quant " + ", ".join(req.kv_quant))
    return "; ".join(parts) or "none"
