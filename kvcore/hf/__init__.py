"""Serve HF ``transformers`` causal LMs through kvcore's paged KV cache (``kvcore[hf]``);
``import kvcore`` never imports transformers, this package does."""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:  # NOTE: the optional extra is missing
    raise ImportError("kvcore.hf needs HF transformers >= 5: pip install 'kvcore[hf]'") from err

from kvcore.hf.engine import Engine, EngineStats
from kvcore.hf.specs import SERVED_MODEL_TYPES, specs_from_config, unsupported_features

__all__ = ["Engine", "EngineStats", "SERVED_MODEL_TYPES", "specs_from_config", "unsupported_features"]
