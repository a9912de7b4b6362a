"""vLLM's multimodal helpers, kept with their names for an engine's model runner; kvcore uses none."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


def scatter_mm_placeholders(embeds: torch.Tensor, is_embed: torch.Tensor | None) -> torch.Tensor:
    """``embeds`` ``[num_embeds, dim]`` at the True positions of the 1-D mask ``is_embed``,
    NaN elsewhere (``is_embed=None``: ``embeds`` itself)."""
    if is_embed is None:
        return embeds
    if is_embed.dtype != torch.bool or is_embed.dim() != 1:
        raise ValueError(f"is_embed must be a 1-D bool mask, got {is_embed.dtype} {tuple(is_embed.shape)}")
    count = int(is_embed.sum())
    if count != embeds.shape[0]:
        raise ValueError(f"is_embed marks {count} positions but there are {embeds.shape[0]} "
                         "embeddings; the mask needs one True per embedding")
    out = embeds.new_full((is_embed.shape[0], embeds.shape[-1]), torch.nan)
    out[is_embed] = embeds
    return out


def gather_mm_placeholders(placeholders: torch.Tensor, is_embed: torch.Tensor | None) -> torch.Tensor:
    """The embeddings at the True positions of ``is_embed`` (undoes the scatter)."""
    if is_embed is None:
        return placeholders
    if is_embed.shape[0] != placeholders.shape[0]:
        raise ValueError(f"is_embed has {is_embed.shape[0]} entries for {placeholders.shape[0]} "
                         "placeholder rows; pass the mask used to scatter them")
    return placeholders[is_embed]


def sanity_check_mm_encoder_outputs(
    mm_embeddings: Sequence[torch.Tensor] | torch.Tensor, expected_num_items: int
) -> None:
    """``ValueError`` unless an encoder returned one 2-D tensor per item (or one 3-D tensor)."""
    hint = "the model's multimodal embedding method returned it"
    if not isinstance(mm_embeddings, (list, tuple, torch.Tensor)):
        raise ValueError("multimodal embeddings must be a list/tuple of 2-D tensors or "
                         f"one 3-D tensor, got {type(mm_embeddings).__name__}; {hint}")
    if len(mm_embeddings) != expected_num_items:
        raise ValueError(f"expected {expected_num_items} multimodal embeddings "
                         f"(one per input item), got {len(mm_embeddings)}; {hint}")
    shapes = [tuple(getattr(e, "shape", ())) for e in mm_embeddings]
    if any(len(s) != 2 for s in shapes):
        raise ValueError(f"each multimodal embedding must be 2-D, got shapes {shapes}; {hint}")


@attrs.define
class EncoderTimingStats:
    """Per-request time spent in the (vision) encoder."""
    encoder_forward_secs: float = 0.0
    num_encoder_calls: int = 0

    def to_dict(self) -> dict[str, float | int]:
        return attrs.asdict(self)
