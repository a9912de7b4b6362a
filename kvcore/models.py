"""Model descriptions in TOML: the layers of a model and the spec of each.

A description names its layer types once and repeats a pattern of them over
the layers::

    name = "Gemma 3 27B"           # shown by `kvcore plan`
    num_layers = 62
    block_size = 16                # default for every type
    pattern = ["local", "local", "local", "local", "local", "global"]
    layer_name = "model.layers.{index}.{module}"   # the default

    [types.local]
    kind = "sliding"               # full | sliding | chunked | mla | cross | encoder_only | mamba
    num_kv_heads = 16
    head_size = 128
    dtype = "bfloat16"
    sliding_window = 1024

    [types.global]
    kind = "full"
    num_kv_heads = 16
    head_size = 128
    dtype = "bfloat16"

``pattern`` repeats until ``num_layers`` layers are named (it may be omitted
when there is one type); the entry ``"-"`` is a layer without a cache (an
MLP-only layer, say), which keeps its index but gets no spec. Every other key
of a type is a field of its spec class (``head_size_v``, ``page_size_padded``,
``tokens_per_state`` as an int or a ``"1/2"`` string, ``block_size``,
``block_stride_alignment`` as an int, ``shapes``/``dtypes`` for ``mamba``), plus
``module``, the last part of the layer name (``self_attn``, or ``mixer`` for
``mamba``). Presets live in ``examples/models/`` and load by file stem.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs
import torch

from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowSpec,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).resolve().parent.parent / "examples" / "models"
NO_CACHE = "-"
_KINDS: dict[str, type[KVCacheSpec]] = {
    "full": FullAttentionSpec,
    "sliding": SlidingWindowSpec,
    "chunked": ChunkedLocalAttentionSpec,
    "mla": MLAAttentionSpec,
    "cross": CrossAttentionSpec,
    "encoder_only": EncoderOnlyAttentionSpec,
    "mamba": MambaSpec,
}
_TOP_KEYS = {"name", "description", "num_layers", "block_size", "pattern", "layer_name", "types"}


@attrs.frozen
class ModelDescription:
    """A loaded model: its name, where it came from and its layer specs in model order."""

    name: str
    source: str
    kv_cache_specs: dict[str, KVCacheSpec] = attrs.field(hash=False)


def preset_names() -> list[str]:
    """Names of the model presets in ``examples/models``."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def find_model(model: str | Path) -> Path:
    """The TOML file of ``model``: a path, or a preset name such as ``llama-3-8b``."""
    path = Path(model)
    if path.is_file():
        return path
    preset = PRESET_DIR / f"{model}.toml"
    if preset.is_file():
        return preset
    raise ValueError(
        f"no model description {str(model)!r}: not a file and not a preset; "
        f"presets: {', '.join(preset_names()) or '(none found)'}"
    )


def _dtype(where: str, name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return value


def _convert(where: str, key: str, value: Any) -> Any:
    if key == "dtype":
        return _dtype(where, value)
    if key == "dtypes":
        return tuple(_dtype(where, v) for v in value)
    if key == "tokens_per_state" and isinstance(value, str):
        return Fraction(value)
    if key == "block_stride_alignment":
        return MultipleOf(value)
    return value


def _spec(type_name: str, table: dict[str, Any], block_size: int) -> tuple[KVCacheSpec, str]:
    where = f"types.{type_name}"
    table = dict(table)
    kind = table.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"{where}.kind is {kind!r}; valid kinds: {', '.join(_KINDS)}")
    cls = _KINDS[kind]
    module = table.pop("module", "mixer" if cls is MambaSpec else "self_attn")
    block_size = table.pop("block_size", block_size)
    fields = set(attrs.fields_dict(cls)) - {"block_size"}
    unknown = sorted(set(table) - fields)
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}; a {kind!r} type takes: "
            f"{', '.join(sorted(fields | {'kind', 'module', 'block_size'}))}"
        )
    kwargs = {k: _convert(where, k, v) for k, v in table.items()}
    try:
        return cls(block_size, **kwargs), module
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def parse_model(data: dict[str, Any], *, block_size: int | None = None) -> dict[str, KVCacheSpec]:
    """Layer name -> spec, in model order, from a parsed TOML description.

    ``block_size`` overrides the block size of every layer type.
    """
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown top-level keys {unknown}; valid: {', '.join(sorted(_TOP_KEYS))}")
    types = data.get("types")
    if not isinstance(types, dict) or not types:
        raise ValueError("a model description needs a [types.NAME] table for each layer type")
    num_layers = data.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    pattern = data.get("pattern", list(types) if len(types) == 1 else None)
    if not isinstance(pattern, list) or not pattern:
        raise ValueError("pattern must list the layer types in order, e.g. ['local', 'global']")
    bad = sorted({p for p in pattern if p != NO_CACHE and p not in types})
    if bad:
        raise ValueError(f"pattern names unknown types {bad}; defined: {', '.join(types)}")
    default_bs = data.get("block_size", 16)
    specs = {}
    for name, table in types.items():
        if block_size is not None:
            table = {**table, "block_size": block_size}
        specs[name] = _spec(name, table, default_bs)
    template = data.get("layer_name", "model.layers.{index}.{module}")
    out: dict[str, KVCacheSpec] = {}
    for index in range(num_layers):
        type_name = pattern[index % len(pattern)]
        if type_name == NO_CACHE:
            continue
        spec, module = specs[type_name]
        out[template.format(index=index, module=module)] = spec
    if len(out) != sum(1 for i in range(num_layers) if pattern[i % len(pattern)] != NO_CACHE):
        raise ValueError(f"layer_name {template!r} gives two layers one name; include {{index}}")
    if not out:
        raise ValueError("the pattern gives no layer a cache; name at least one type")
    return out


def load_model(model: str | Path, *, block_size: int | None = None) -> ModelDescription:
    """Load a model description from a TOML path or a preset name."""
    path = find_model(model)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    try:
        specs = parse_model(data, block_size=block_size)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return ModelDescription(str(data.get("name", path.stem)), str(path), specs)
