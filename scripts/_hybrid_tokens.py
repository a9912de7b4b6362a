"""Hybrid models on a CUDA GPU: float32 tokens equal model.generate for every served hybrid.

Each architecture's small random model (kvcore.hf.models) serves prompts of
mixed lengths through kvcore.hf.Engine with a token budget that splits
prompts into chunks and fewer sequences than prompts, with the Triton and the
torch attention backends; then the bf16 model's cache
dtypes are compared with the specs (recurrent states float32). Prints one
line per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvcore.hf import Engine, specs_from_config
from kvcore.hf.models import model_config, random_model
from kvcore.specs.state import MambaSpec

ARCHS = ["bamba", "granitemoehybrid", "granitemoehybrid-dense", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next"]


def main() -> int:
    device = torch.device("cuda")
    # NOTE: cuDNN convolutions (the mixers' conv1d) default to TF32, whose rounding depends on the shape
    # of the call; a [1, n] chunk and a whole prompt must round alike for a float32 comparison.
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 90, 17, 1, 63, 40, 128, 9)]
    results, bad = [], 0
    for arch in ARCHS:
        model = random_model(model_config(arch), device=device, seed=1)
        with torch.inference_mode():
            want = [model.generate(torch.tensor([p], device=device), max_new_tokens=12, do_sample=False)[0, len(p):]
                    .tolist() for p in prompts]
        for backend in ("triton", "torch"):
            t0 = time.perf_counter()
            engine = Engine(model, backend=backend, num_blocks=40, max_num_seqs=3, max_num_batched_tokens=48)
            got = engine.generate(prompts, 12)
            same = sum(a == b for a, b in zip(got, want))
            bad += same != len(prompts)
            results.append({"arch": arch, "backend": backend, "equal": same, "requests": len(prompts),
                            "steps": engine.stats().steps, "seconds": round(time.perf_counter() - t0, 2)})
            print(f"{arch:24s} {backend:6s} float32 tokens equal model.generate: {same}/{len(prompts)}", flush=True)
        before = bad
        model = model.to(torch.bfloat16)
        specs = specs_from_config(model.config, dtype=torch.bfloat16)
        with torch.no_grad():
            cache = model(torch.tensor([[5, 6, 7, 8]], device=device), use_cache=True).past_key_values
        for name, spec in specs.items():
            if isinstance(spec, MambaSpec):
                layer = cache.layers[int(name.split(".")[2])]
                kept = [layer.recurrent_states[0], layer.conv_states[0]] if len(spec.shapes) == 2 else [
                    layer.conv_states[0]]
                ok = [t.dtype for t in kept] == list(spec.dtypes) and [tuple(t.shape[1:]) for t in kept] == list(
                    spec.shapes)
                bad += not ok
                if not ok:
                    print(f"{arch}: {name} spec {spec.shapes} {spec.dtypes} but transformers keeps "
                          f"{[(tuple(t.shape), t.dtype) for t in kept]}")
        print(f"{arch:24s} bf16 state specs match transformers' cache: {'yes' if bad == before else 'NO'}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            json.dump(results, fh, indent=1)
    print("OK" if not bad else f"FAIL: {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
