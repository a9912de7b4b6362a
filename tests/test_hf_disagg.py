"""kvcore.hf.disagg: a prompt's cached prefix blocks handed from a prefill engine to a decode engine.

The bytes move here through two ``HostKVPool`` mirrors (offload on one
side, restore on the other, one KV cache group at a time), so these tests
need no NIXL; examples/disaggregated.py moves them with NIXL between
processes (tests/test_transfer_example.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from kvcore.errors import OutOfBlocksError  # noqa: E402
from kvcore.hf import Engine  # noqa: E402
from kvcore.hf.disagg import PrefixBlocks, export_prefix, import_prefix, release_prefix, reserve_prefix  # noqa: E402
from kvcore.hf.models import model_config, random_model  # noqa: E402
from kvcore.transfer import HostKVPool  # noqa: E402

LENGTHS = [5, 40, 17, 53, 16]
NEW = 6
WINDOW_BLOCKS = 2  # gemma3's test config: sliding window 24 at block size 16


def prompts_for(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(model_config(arch), seed=1) for arch in ("llama", "gemma3")}


def engine(model, num_blocks=40, **kw):
    # NOTE: the torch backend by name: "auto" would take whatever plugin is installed
    return Engine(model, num_blocks=num_blocks, enable_prefix_caching=True, **{"backend": "torch", **kw})


def copy_blocks(src, exported, dst, reserved):
    """Move the held blocks of ``exported`` (in ``src``) into ``reserved`` (in ``dst``) through host mirrors."""
    for g in range(len(exported.block_ids)):
        remote, local = exported.held_ids(g), reserved.held_ids(g)
        assert len(remote) == len(local)
        if remote:
            a, b = HostKVPool(src.kv, len(remote)), HostKVPool(dst.kv, len(local))
            a.offload(remote, list(range(len(remote))), group_id=g)
            b.host.copy_(a.host)
            b.restore(list(range(len(local))), local, group_id=g)


def hand_off(prefill, decode, prompts, *, fill=True):
    exported = [export_prefix(prefill, p) for p in prompts]
    for e in exported:
        reserved = reserve_prefix(decode, e)
        if fill:
            copy_blocks(prefill, e, decode, reserved)
        import_prefix(decode, reserved)
        release_prefix(prefill, e)
    return exported


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_engine_serves_model_generate_tokens_from_handed_off_blocks(models, arch):
    model, prompts = models[arch], prompts_for(LENGTHS)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    prefill = engine(model)
    prefill.generate(prompts, 1)
    decode = engine(model, num_blocks=47)
    decode.kv.block_pool.allocate(5)  # held by others: the decode side's ids differ from the prefill's
    decode.kv.begin_step()
    exported = hand_off(prefill, decode, prompts)
    # Full blocks short of the last token: 0, 2, 1, 3 and 0 blocks (16 tokens: the last one is recomputed).
    assert [e.num_tokens for e in exported] == [0, 32, 16, 48, 0]
    if arch == "gemma3":  # group 0 slides: only the window's blocks before the boundary are held
        assert [sum(b == 0 for b in e.block_ids[0]) for e in exported] == [0, 0, 0, 3 - WINDOW_BLOCKS, 0]
        assert all(0 not in e.block_ids[1] for e in exported)
    assert decode.generate(prompts, NEW) == expected
    stats = decode.stats()
    moved = sum(e.num_tokens for e in exported)
    assert stats.prefix_cache_hits == 3 and stats.prefix_cache_hit_tokens == moved
    assert stats.prefill_tokens == sum(LENGTHS) - moved
    # The prefill side released everything: its blocks are free again (cached, evictable).
    assert prefill.kv.block_pool.num_free_blocks == prefill.kv.num_blocks - 1


def test_blocks_registered_unfilled_change_the_tokens(models):
    model, prompts = models["llama"], prompts_for(LENGTHS)
    prefill = engine(model)
    want = prefill.generate(prompts, NEW)
    blank = engine(model)
    exported = hand_off(prefill, blank, prompts, fill=False)
    got = blank.generate(prompts, NEW)
    assert blank.stats().prefix_cache_hit_tokens == sum(e.num_tokens for e in exported)
    assert [g != w for g, w in zip(got, want)] == [e.num_tokens > 0 for e in exported]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(length=st.integers(1, 90), block_size=st.sampled_from([4, 8, 16]))
def test_exported_and_imported_prefixes_are_the_cache_hit(models, length, block_size):
    model = models["gemma3"]
    prompt = prompts_for([length], seed=length)[0]
    prefill, decode = engine(model, 60, block_size=block_size), engine(model, 60, block_size=block_size)
    prefill.generate([prompt], 1)
    exported = export_prefix(prefill, prompt)
    tokens = (length - 1) // block_size * block_size
    assert exported.tokens == tuple(prompt[:tokens])
    window = -(-23 // block_size)  # sliding window 24
    n = tokens // block_size
    assert [len(g) for g in exported.block_ids] == [n, n]
    assert exported.block_ids[0][: max(0, n - window)] == (0,) * max(0, n - window)
    held = [b for g in range(2) for b in exported.held_ids(g)]
    assert len(set(held)) == len(held) and all(prefill.kv.block_pool.ref_count(b) == 1 for b in held)
    free = decode.kv.block_pool.num_free_blocks
    reserved = reserve_prefix(decode, exported)
    assert decode.kv.block_pool.num_free_blocks == free - len(held)
    import_prefix(decode, reserved)
    assert decode.kv.block_pool.num_free_blocks == free  # cached, evictable
    again = export_prefix(decode, prompt)  # the decode engine's own prefix cache now hits those blocks
    assert again == reserved
    release_prefix(decode, again)
    release_prefix(prefill, exported)
    assert prefill.kv.block_pool.num_free_blocks == prefill.kv.num_blocks - 1


def test_bad_hand_offs_are_refused_and_change_nothing(models):
    prompt = prompts_for([40])[0]
    llama, gemma = engine(models["llama"]), engine(models["gemma3"])
    llama.generate([prompt], 1)
    exported = export_prefix(llama, prompt)
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        export_prefix(Engine(models["llama"], num_blocks=20), prompt)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        export_prefix(llama, [1, 2, 999])
    with pytest.raises(ValueError, match="2 KV cache groups|1 KV cache groups"):
        reserve_prefix(gemma, exported)
    with pytest.raises(ValueError, match="block sizes"):
        reserve_prefix(engine(models["llama"], block_size=24), exported)
    with pytest.raises(ValueError, match="null ones"):
        reserve_prefix(llama, PrefixBlocks(exported.tokens, [(0, 5)]))
    with pytest.raises(TypeError, match="PrefixBlocks"):
        import_prefix(llama, exported.block_ids)
    small = engine(models["llama"], num_blocks=2)
    with pytest.raises(OutOfBlocksError):
        reserve_prefix(small, exported)
    assert small.kv.block_pool.num_free_blocks == 1
    release_prefix(llama, exported)
    with pytest.raises(ValueError, match="not held"):
        import_prefix(llama, exported)  # released already: nothing is cached twice or freed twice
    assert llama.kv.block_pool.num_free_blocks == llama.kv.num_blocks - 1
