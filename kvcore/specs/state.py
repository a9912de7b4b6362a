"""State-cache specs (Mamba/SSM): one state per block."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from kvcore._validate import as_int, positive_int
from kvcore.specs.base import KVCacheSpec, check_cache_dtype, optional_positive, padded_page_size


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    try:
        shapes = [tuple(shape) for shape in value]
    except TypeError:
        raise TypeError("MambaSpec.shapes must be a sequence of shapes (e.g. "
                        f"[(4, 128), (8, 64)]), got {value!r}") from None
    return tuple(tuple(as_int(f"MambaSpec.shapes[{i}] dim", d) for d in shape) for i, shape in enumerate(shapes))


def _dtypes(value: Any) -> tuple[torch.dtype, ...]:
    if isinstance(value, torch.dtype):
        value = (value,)
    try:
        dtypes = tuple(value)
    except TypeError:
        raise TypeError(f"MambaSpec.dtypes must be a torch.dtype or a sequence of them, got {value!r}") from None
    return tuple(check_cache_dtype(f"MambaSpec.dtypes[{i}]", d) for i, d in enumerate(dtypes))


def _mamba_type(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"MambaSpec.mamba_type must be a non-empty str such as 'mamba2' or None, got {value!r}")


@attrs.frozen
class MambaSpec(KVCacheSpec):
    """A state cache (Mamba/SSM): one state per block holding tensors of ``shapes``/``dtypes``;
    the page is the sum of their bytes (or ``page_size_padded``), views ``[B, 1, 1, C]``.
    ``mamba_type`` names the mixer that keeps the states (``"mamba2"``, ``"short_conv"``,
    ``"gated_delta_net"``, ...): mixer backends are chosen by it."""

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_dtypes)
    page_size_padded: int | None = optional_positive()  # type: ignore[assignment]
    mamba_type: str | None = attrs.field(default=None, kw_only=True, validator=_mamba_type)

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(f"{name} needs one dtype per state shape and at least one state, "
                             f"got {len(self.shapes)} shapes and {len(self.dtypes)} dtypes")
        for shape in self.shapes:
            if any(d <= 0 for d in shape):
                raise ValueError(f"{name}: state shape {shape} has a non-positive dim")
        self._check_page_padding(f"{self.dtype_alignment} bytes (its largest state element)")

    page_size_bytes = property(padded_page_size)

    state_content_size_bytes = property(lambda self: sum(self.state_bytes),
                                        doc="``C``: the bytes of all state tensors together.")
    dtype_alignment = property(lambda self: max(d.itemsize for d in self.dtypes),
                               doc="The largest state element, in bytes.")

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor, in order."""
        return tuple(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    view_dtype = property(lambda self: self.dtypes[0] if len(set(self.dtypes)) == 1 else torch.int8,
                          doc="The common dtype of all states, or ``torch.int8`` when they differ.")

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        positive_int("max_model_len", max_model_len)
        return 1

    def split_states(self, view: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[B, 1, 1, C]`` layer view into one ``[B, *shape]`` tensor per state
        (``ValueError`` unless each state starts, and blocks stride, at whole elements)."""
        if not isinstance(view, torch.Tensor) or view.dim() != 4 or view.shape[1:3] != (1, 1):
            shown = tuple(view.shape) if isinstance(view, torch.Tensor) else repr(view)
            raise ValueError(f"split_states needs a [B, 1, 1, C] layer view, got {shown}")
        raw = view.view(torch.int8)[:, 0, 0, :]
        if raw.shape[1] != self.state_content_size_bytes:
            raise ValueError(f"the view holds {raw.shape[1]} bytes per block, this spec's states "
                             f"{self.state_content_size_bytes}; pass a view made for this spec")
        out, start = [], 0
        for i, (shape, dtype, nbytes) in enumerate(zip(self.shapes, self.dtypes, self.state_bytes)):
            offset = raw.storage_offset() + start
            if offset % dtype.itemsize or raw.stride(0) % dtype.itemsize:
                raise ValueError(f"state {i} ({dtype}) starts at byte {offset} with block "
                                 f"stride {raw.stride(0)}, not multiples of {dtype.itemsize}; "
                                 "order the states by decreasing element size or pad the page")
            out.append(raw[:, start : start + nbytes].view(dtype).reshape(raw.shape[0], *shape))
            start += nbytes
        return out
