"""kvcore.hf.Engine on the torch backend: NaN in block 0 (the null block padded and out-of-window
block-table entries point at) changes no token, in attention and in a hybrid's state views."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_reference import prompts_for, reference  # noqa: E402

from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402

# Prompts longer than mistral's and gemma3's 24-token window: out-of-window blocks go back to block 0.
PROMPT_LENS, MAX_NEW = [5, 41, 17], 4


def poison_null_block(engine: Engine) -> None:
    """NaN in every byte of manager block 0 of every view (attention and state)."""
    kv = engine.kv
    for view in kv.kv_caches.values():
        view[: view.shape[0] // kv.max_num_blocks] = float("nan")


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "bamba"])
def test_nan_in_the_null_block_changes_no_token(arch):
    model = random_model(model_config(arch), seed=1)
    prompts = prompts_for(PROMPT_LENS, seed=3)
    engine = Engine(model, backend="torch", num_blocks=40, max_num_seqs=3, max_num_batched_tokens=16)
    poison_null_block(engine)
    assert engine.generate(prompts, MAX_NEW) == reference(model, prompts, MAX_NEW)
