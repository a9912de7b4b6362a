"""examples/disaggregated.py: prefill and decode in two processes, KV moved by NIXL, same tokens."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "disaggregated.py"


def _nixl_importable() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12"))


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("disaggregated_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decoded_tokens_depend_on_the_prompt_kv():
    """The control: decoding over an empty cache gives other tokens, so a match proves the KV arrived."""
    ex = _example()
    args = ex.parse_args(["--new-tokens", "6"])
    reference = ex.one_process(args)
    runner = ex.PagedModel(args, num_blocks=args.prefill_blocks)
    _, first = runner.prefill(args.prompt_list)
    blank = ex.PagedModel(args, num_blocks=args.prefill_blocks)
    tables = [blank.allocate(len(p)) for p in args.prompt_list]
    blank.kv.begin_step()
    assert blank.decode(args.prompt_list, first, tables, 6) != reference


@pytest.mark.skipif(not _nixl_importable(), reason="NIXL is not installed (pip install kvcore[nixl])")
def test_two_process_run_matches_the_one_process_run():
    from _transfer_caches import make_cache
    from kvcore.transfer import NixlAgent

    try:  # UCX cannot start in some sandboxes: then there is nothing to test here
        NixlAgent("probe", make_cache("uniform", "LBNHC")).close()
    except Exception as exc:
        pytest.skip(f"NIXL/UCX could not start here: {exc!r}")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--layout", "LHBNC", "--new-tokens", "6"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "tokens equal the one-process run" in proc.stdout
    assert "through NIXL" in proc.stdout
