"""kvcore.block_hashes: chained, keyed, deterministic hashes of full blocks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import block_hashes, sliding_window_blocks

tokens_st = st.lists(st.integers(0, 2**32), max_size=40)
size_st = st.integers(1, 6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=tokens_st, block_size=size_st)
def test_one_hash_per_full_block_depending_only_on_the_prefix(tokens, block_size):
    hashes = block_hashes(tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    assert all(type(h) is bytes and len(h) == 16 for h in hashes)
    for k in range(len(hashes) + 1):  # the partial tail changes nothing
        assert block_hashes(tokens[: k * block_size + block_size - 1], block_size) == hashes[:k]
    assert len(set(hashes)) == len(hashes)  # chained: equal blocks at different depths differ


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=tokens_st.filter(bool), block_size=size_st, data=st.data())
def test_changing_a_token_changes_its_block_and_every_later_one(tokens, block_size, data):
    hashes = block_hashes(tokens, block_size)
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens[:i], tokens[i] + 1, *tokens[i + 1 :]]
    other = block_hashes(changed, block_size)
    block = i // block_size
    assert other[:block] == hashes[:block]
    assert all(a != b for a, b in zip(other[block:], hashes[block:]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(tokens=tokens_st, block_size=size_st, data=st.data())
def test_parent_continues_the_chain(tokens, block_size, data):
    hashes = block_hashes(tokens, block_size)
    if not hashes:
        return
    k = data.draw(st.integers(1, len(hashes)))
    assert block_hashes(tokens[k * block_size :], block_size, parent=hashes[k - 1]) == hashes[k:]


def test_extra_keys_and_block_size_change_every_hash():
    tokens = list(range(100, 124))
    base = block_hashes(tokens, 4)
    variants = [
        block_hashes(tokens, 4, extra_keys=("lora-a",)),
        block_hashes(tokens, 4, extra_keys=("lora-b",)),
        block_hashes(tokens, 4, extra_keys=(1,)),
        block_hashes(tokens, 4, extra_keys=("1",)),
        block_hashes(tokens, 4, extra_keys=(b"1",)),
        block_hashes(tokens, 4, extra_keys=(1, 2)),
        block_hashes(tokens, 4, extra_keys=(12,)),
        block_hashes(tokens, 4, extra_keys=("ab", "c")),
        block_hashes(tokens, 4, extra_keys=("a", "bc")),
        block_hashes(tokens, 4, extra_keys=(-1,)),
        block_hashes(tokens, 4, extra_keys=(255,)),
        block_hashes(tokens, 4, parent=b"\x00" * 16),
    ]
    every_block = [base, *variants]
    for i in range(len(base)):
        assert len({hs[i] for hs in every_block}) == len(every_block)
    assert not set(block_hashes(tokens, 8)) & set(base) and not set(block_hashes(tokens, 3)) & set(base)
    assert block_hashes(tokens, 4, extra_keys="lora-a") == variants[0]  # one key alone
    assert block_hashes(tokens, 4, extra_keys=[]) == base


def test_tensors_tuples_and_lists_hash_alike():
    tokens = [7, 0, 2**40, 3, 99, 5]
    expected = block_hashes(tokens, 2)
    assert block_hashes(tuple(tokens), 2) == expected
    assert block_hashes(torch.tensor(tokens), 2) == expected
    assert block_hashes(iter(tokens), 2) == expected


_SNIPPET = "from kvcore import block_hashes; print(block_hashes(list(range(3, 40)), 5, extra_keys=('x', 7))[-1].hex())"


def test_hashes_are_equal_in_another_process():
    here = block_hashes(list(range(3, 40)), 5, extra_keys=("x", 7))[-1].hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(token_ids=[1, -2], block_size=2), ValueError, r"token_ids\[1\] = -2"),
        (dict(token_ids=[1, 2**64], block_size=2), ValueError, r"token_ids\[1\]"),
        (dict(token_ids=[1, 2.0], block_size=2), TypeError, r"token_ids\[1\]"),
        (dict(token_ids=[1, 2], block_size=0), ValueError, "block_size"),
        (dict(token_ids=[1, 2], block_size=2.0), TypeError, "block_size"),
        (dict(token_ids=[1, 2], block_size=2, parent="ab"), TypeError, "parent"),
        (dict(token_ids=[1, 2], block_size=2, parent=b""), TypeError, "parent"),
        (dict(token_ids=[1, 2], block_size=2, extra_keys=(1.5,)), TypeError, r"extra_keys\[0\]"),
        (dict(token_ids=[1, 2], block_size=2, extra_keys=(None,)), TypeError, r"extra_keys\[0\]"),
        (dict(token_ids=[1, 2], block_size=2, extra_keys=True), TypeError, r"extra_keys\[0\]"),
        (dict(token_ids=[1, 2], block_size=2, extra_keys=2.5), TypeError, "extra_keys must be"),
        (dict(token_ids=torch.tensor(3), block_size=2), TypeError, "one-dimensional"),
    ],
)
def test_bad_input_is_refused_naming_the_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        block_hashes(**kwargs)


@pytest.mark.parametrize("window, block_size, blocks", [(4096, 16, 256), (17, 16, 1), (33, 16, 2), (1, 16, 1)])
def test_sliding_window_blocks(window, block_size, blocks):
    assert sliding_window_blocks(window, block_size) == blocks
