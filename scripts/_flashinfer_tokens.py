"""Engine(backend="flashinfer") vs Engine(backend="torch") on the same bf16 Llama and Gemma 3 (GPU).

Random-weight models (head 128, 4 layers, GQA 8/2; Gemma 3 with sliding and
full layers, query_pre_attn_scalar 24 so its scale is not head**-0.5), the
same prompts (prefill, chunked prefill, decode): prints the share of tokens
equal, the first step where each request differs, and graph steps taken.

    python scripts/_flashinfer_tokens.py [llama gemma3] [--json-out PATH]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvcore.hf import Engine
from kvcore.hf.models import model_config, random_model


def compare(arch: str) -> dict:
    config = model_config(arch, head_dim=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = random_model(config, dtype=torch.bfloat16, device="cuda", seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 130, 300, 17, 77)]
    out = {}
    for backend in ("torch", "triton", "flashinfer"):
        start = time.perf_counter()
        engine = Engine(model, backend=backend, block_size=16, max_num_seqs=8, max_num_batched_tokens=128,
                        num_blocks=200)
        built = time.perf_counter() - start
        start = time.perf_counter()
        tokens = engine.generate(prompts, 24)
        out[backend] = {"tokens": tokens, "build_s": built, "generate_s": time.perf_counter() - start,
                        "graph_steps": engine.stats().graph_steps}
    ref, got = out["torch"]["tokens"], out["flashinfer"]["tokens"]
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(ref, got)]
    # NOTE: the control: how far two correct bf16 backends drift apart on this model.
    control = sum(a == b for r, g in zip(ref, out["triton"]["tokens"]) for a, b in zip(r, g))
    return {"arch": arch, "equal_tokens": same, "tokens": total, "first_difference": first,
            "triton_equal_tokens": control,
            "flashinfer": {k: v for k, v in out["flashinfer"].items() if k != "tokens"},
            "torch": {k: v for k, v in out["torch"].items() if k != "tokens"}}


def main(argv: list[str]) -> int:
    path = argv[argv.index("--json-out") + 1] if "--json-out" in argv else None
    archs = [a for a in argv if not a.startswith("--") and a != path] or ["llama", "gemma3"]
    results = []
    for arch in archs:
        r = compare(arch)
        results.append(r)
        print(f"{arch}: flashinfer == torch on {r['equal_tokens']}/{r['tokens']} tokens "
              f"(first difference per request: {r['first_difference']}); control: triton == torch on "
              f"{r['triton_equal_tokens']}/{r['tokens']}; flashinfer built in "
              f"{r['flashinfer']['build_s']:.1f} s, generate {r['flashinfer']['generate_s']:.1f} s, "
              f"{r['flashinfer']['graph_steps']} graph steps", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
