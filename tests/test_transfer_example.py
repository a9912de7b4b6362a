"""examples/disaggregated.py: an HF model's prefill and decode in two processes, KV moved by NIXL.

The two-process run must give the tokens of ``model.generate`` (computed
here, not taken from the example's own check) while its decode engine
computes only the prompts' tails. The controls run in this process: a
decode engine given no KV computes every prompt token, and one whose
prefix cache holds the prompts' blocks unfilled gives other tokens, so a
match proves the transferred bytes were used.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvcore.hf.disagg import import_prefix, reserve_prefix  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "disaggregated.py"
PROMPT_LINE = re.compile(r"^prompt (\d+) \((\d+) tokens, (\d+) transferred\): (\[[\d, ]*\])$", re.M)
TRANSFER_LINE = re.compile(r"transfer of the prompts' KV: ([\d.]+) ms .*transport (\S+) \(")
STATS_LINE = re.compile(r"computed (\d+) of (\d+) prompt tokens, (\d+) came from its prefix cache \((\d+) hits\)")


def _nixl_importable() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12"))


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("disaggregated_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_the_transferred_kv_the_decode_engine_misses_or_goes_wrong(ex):
    args = ex.parse_args(["--arch", "llama", "--new-tokens", "6"])
    prompts = args.prompt_list
    served, expected = ex.one_process(args)
    assert served == expected
    prefill = ex.build_engine(args, args.prefill_blocks)
    exported = ex.prefill(prefill, prompts)
    moved = sum(e.num_tokens for e in exported)
    assert moved > 0

    cold = ex.build_engine(args, args.decode_blocks)  # nothing imported: a miss, every prompt token computed
    assert cold.generate(prompts, 6) == expected
    stats = cold.stats()
    assert stats.prefix_cache_hits == 0 and stats.prefill_tokens == sum(map(len, prompts))

    blank = ex.build_engine(args, args.decode_blocks)  # the blocks registered but never filled
    for e in exported:
        import_prefix(blank, reserve_prefix(blank, e))
    tokens = blank.generate(prompts, 6)
    assert blank.stats().prefix_cache_hit_tokens == moved
    assert all((got != want) for got, want, e in zip(tokens, expected, exported) if e.num_tokens)


@pytest.mark.skipif(not _nixl_importable(), reason="NIXL is not installed (pip install kvcore[nixl])")
def test_two_processes_give_the_tokens_of_model_generate_and_skip_the_prompt(ex):
    from _transfer_caches import make_cache

    from kvcore.transfer import NixlAgent

    try:  # UCX cannot start in some sandboxes: then there is nothing to test here
        NixlAgent("probe", make_cache("uniform", "LBNHC")).close()
    except Exception as exc:
        pytest.skip(f"NIXL/UCX could not start here: {exc!r}")
    # Gemma 3: a sliding and a full group (two reads, the window's blocks only), a layer-compact layout.
    argv = ["--arch", "gemma3", "--layout", "LHBNC", "--prompts", "4", "--new-tokens", "6"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():  # NOTE: the example runs on CUDA where there is one (compiled)
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(EXAMPLE), *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert all(len(line) <= 80 for line in proc.stdout.splitlines()), proc.stdout
    stdout = proc.stdout.replace("\n  ", " ")  # a report line wrapped at 80 columns, as one line
    args = ex.parse_args(argv)
    _, expected = ex.one_process(args)
    lines = PROMPT_LINE.findall(stdout)
    assert [int(i) for i, *_ in lines] == list(range(len(args.prompt_list)))
    assert [ast.literal_eval(tokens) for *_, tokens in lines] == expected
    lengths = [len(p) for p in args.prompt_list]
    assert [int(n) for _, n, _, _ in lines] == lengths
    moved = [int(m) for _, _, m, _ in lines]
    # Each prompt's full blocks short of its last token moved (block size 16).
    assert moved == [(n - 1) // 16 * 16 for n in lengths] and sum(moved) > 0
    computed, total, hit, hits = map(int, STATS_LINE.search(stdout).groups())
    assert (total, hit, hits) == (sum(lengths), sum(moved), sum(m > 0 for m in moved))
    assert computed == total - hit
    assert "through NIXL" in stdout
    timing = TRANSFER_LINE.search(stdout)
    assert timing and float(timing.group(1)) > 0
    # Two processes on one host: cuda_ipc between GPU caches, shared memory (cma) between host caches.
    assert timing.group(2) == ("cuda_ipc" if args.device == "cuda" else "cma")
