"""Model descriptions in TOML for ``kvcore plan``: layer types, and a pattern of them repeated
over the layers (the format: docs/model-files.md). Presets ship in ``kvcore/presets/``."""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs
import torch

from kvcore import specs
from kvcore.specs import KVCacheSpec, MambaSpec, MultipleOf
from kvcore.specs.quant import quantize_specs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The model presets, shipped with the package (wheel installs included).
PRESET_DIR = Path(__file__).resolve().parent / "presets"
NO_CACHE = "-"
_KINDS: dict[str, type[KVCacheSpec]] = {
    "full": specs.FullAttentionSpec,
    "sliding": specs.SlidingWindowSpec,
    "chunked": specs.ChunkedLocalAttentionSpec,
    "mla": specs.MLAAttentionSpec,
    "cross": specs.CrossAttentionSpec,
    "encoder_only": specs.EncoderOnlyAttentionSpec,
    "mamba": MambaSpec,
}
#: State blocks of a separate state region when the file does not say: 256 sequences and the null block.
DEFAULT_STATE_BLOCKS = 257
MAX_LAYERS = 10_000  # NOTE: real models have a few hundred; more is a typo
MAX_PAGE_BYTES = 1 << 40  # one block of one layer: 1 TiB (more is a typo)
_TOP_KEYS = {"name", "description", "num_layers", "block_size", "pattern", "layer_name", "types",
             "separate_state_pages", "num_state_blocks", "kv_cache_dtype"}
_OWN_KEYS = {"kind", "module", "block_size"}
# NOTE: a full-attention spec's window fields record merged layers (a file says kind =
# "sliding" instead), and MLA keeps no separate V.
_WINDOWS = {"sliding_window", "attention_chunk_size"}
_NOT_FOR = {"full": _WINDOWS, "mla": _WINDOWS | {"head_size_v"}}
_HINTS = {
    "sliding_window": "for sliding-window layers use kind = 'sliding'",
    "attention_chunk_size": "for chunked local attention use kind = 'chunked'",
}
_REQUIRED = {
    "num_kv_heads": "KV heads per layer, an integer",
    "head_size": "values per head, an integer",
    "dtype": "a torch dtype name such as 'bfloat16'",
    "sliding_window": "the window in tokens, an integer such as 4096",
    "attention_chunk_size": "the chunk in tokens, an integer such as 8192",
    "shapes": "one shape per state, such as [[3, 8192], [8192, 16]]",
    "dtypes": "one dtype name per state, such as ['bfloat16', 'float32']",
}


@attrs.frozen
class ModelDescription:
    """A loaded model: its name, where it came from and its layer specs in model order."""

    name: str
    source: str
    kv_cache_specs: dict[str, KVCacheSpec] = attrs.field(hash=False)
    #: ``plan_kv_cache``'s keywords for a separate state region (``separate_state_pages = true``
    #: and ``num_state_blocks``, default 257) or none.
    plan_options: dict[str, Any] = attrs.field(factory=dict, hash=False)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def find_model(model: str | Path) -> Path:
    """The TOML file of ``model``: a path, or a preset name such as ``llama-3-8b``."""
    for path in (Path(model), PRESET_DIR / f"{model}.toml"):
        if path.is_file():
            return path
    raise ValueError(f"no model description {str(model)!r}: not a file and not a "
                     f"preset; presets: {', '.join(preset_names()) or '(none found)'}")


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return value


def _convert(key: str, value: Any) -> Any:
    """A TOML value as the spec field ``key`` takes it (the caller names the table on error)."""
    if key == "dtype":
        return _dtype(value)
    if key == "dtypes":
        return tuple(_dtype(v) for v in value)
    if key == "tokens_per_state" and isinstance(value, str):
        return Fraction(value)
    return MultipleOf(value) if key == "block_stride_alignment" else value


def _spec(type_name: str, table: Any, block_size: int, layers: list[int]) -> tuple[KVCacheSpec, str]:
    """The spec of one type table and its module; ``layers``: the indices that use it."""
    where = f"types.{type_name}"
    if layers:
        more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
        where += f" (layer {layers[0]}{more})"
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table of keys, got {table!r}")
    table = dict(table)
    kind = table.pop("kind", None)
    if kind not in _KINDS:
        raise ValueError(f"{where}.kind is {kind!r}; valid kinds: {', '.join(_KINDS)}")
    cls = _KINDS[kind]
    module = table.pop("module", "mixer" if cls is MambaSpec else "self_attn")
    block_size = table.pop("block_size", block_size)
    valid = set(attrs.fields_dict(cls)) - _NOT_FOR.get(kind, set()) | _OWN_KEYS
    unknown = sorted(set(table) - valid)
    if unknown:
        hints = [f"; {_HINTS[k]}" for k in unknown if k in _HINTS]
        raise ValueError(f"{where} has unknown keys {unknown}; a {kind!r} type "
                         f"takes: {', '.join(sorted(valid))}{''.join(hints)}")
    required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.init]
    missing = [k for k in required if k not in table and k != "block_size"]
    if missing:
        keys = ", ".join(f"{k} ({_REQUIRED[k]})" if k in _REQUIRED else k for k in missing)
        raise ValueError(f"{where}: a {kind!r} type needs the key{'s' * (len(missing) > 1)} {keys}")
    try:
        spec = cls(block_size, **{k: _convert(k, v) for k, v in table.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    if spec.page_size_bytes > MAX_PAGE_BYTES:
        raise ValueError(f"{where}: one block of one layer takes {spec.page_size_bytes:,} bytes, more than "
                         f"{MAX_PAGE_BYTES:,} (1 TiB); check block_size, num_kv_heads, head_size and shapes")
    return spec, module


def parse_model(data: dict[str, Any], *, block_size: int | None = None, kv_cache_dtype: str | None = None) -> dict:
    """Layer name -> spec, in model order, of a parsed TOML description (attention layers stored
    as ``kv_cache_dtype`` says, else as the file's ``kv_cache_dtype``, else unquantized)."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"unknown top-level keys {unknown}; valid: {', '.join(sorted(_TOP_KEYS))}")
    types = data.get("types")
    if not isinstance(types, dict) or not types:
        raise ValueError("a model description needs a [types.NAME] table for each layer type")
    num_layers = data.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if num_layers > MAX_LAYERS:
        raise ValueError(f"num_layers = {num_layers:,} is more than the {MAX_LAYERS:,} layers "
                         "kvcore plans (real models have a few hundred); check the value")
    pattern = data.get("pattern", list(types) if len(types) == 1 else None)
    if not isinstance(pattern, list) or not pattern:
        raise ValueError("pattern must list the layer types in order, e.g. ['local', 'global']")
    bad = sorted({str(p) for p in pattern if p != NO_CACHE and p not in types})
    if bad:
        raise ValueError(f"pattern names unknown types {bad}; defined: {', '.join(types)}")
    template = data.get("layer_name", "model.layers.{index}.{module}")
    layer_types = [pattern[index % len(pattern)] for index in range(num_layers)]
    by_type = {}
    for name, table in types.items():
        if block_size is not None and isinstance(table, dict):
            table = {**table, "block_size": block_size}
        used = [index for index, t in enumerate(layer_types) if t == name]  # so errors name a layer
        by_type[name] = _spec(name, table, data.get("block_size", 16), used)
    out: dict[str, KVCacheSpec] = {}
    for index, type_name in enumerate(layer_types):
        if type_name != NO_CACHE:
            spec, module = by_type[type_name]
            out[_layer_name(template, index, module)] = spec
    if len(out) != sum(t != NO_CACHE for t in layer_types):
        raise ValueError(f"layer_name {template!r} gives two layers one name; include {{index}}")
    if not out:
        raise ValueError("the pattern gives no layer a cache; name at least one type")
    return quantize_specs(out, data.get("kv_cache_dtype", "auto") if kv_cache_dtype is None else kv_cache_dtype)


def _layer_name(template: Any, index: int, module: str) -> str:
    try:
        return str(template).format(index=index, module=module)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"layer_name {template!r} is not a valid template ({exc!r}); use the fields "
                         "{index} and {module}, e.g. 'model.layers.{index}.{module}'") from None


def load_model_file(model: str | Path, *, block_size: int | None = None, kv_cache_dtype: str | None = None):
    """Load a model from a TOML path or a preset name (``block_size``: that of every type;
    ``kv_cache_dtype``: how attention layers are stored, overriding the file's)."""
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
    ):
        raise ValueError(f"block_size={block_size!r} (the block size given for every layer "
                         "type) must be a positive integer number of tokens, such as 16")
    path = find_model(model)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a TOML model description: byte {exc.start} "
                         "is not UTF-8 text (is it a binary file?)") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    try:
        layer_specs = parse_model(data, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    options = {k: data[k] for k in ("separate_state_pages", "num_state_blocks") if k in data}
    if options.get("separate_state_pages") is True:
        options.setdefault("num_state_blocks", DEFAULT_STATE_BLOCKS)
    return ModelDescription(str(data.get("name", path.stem)), str(path), layer_specs, options)
