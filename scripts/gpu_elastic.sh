#!/usr/bin/env bash
# Elastic KV cache on one CUDA GPU, in one go (repository root; about 2-3 minutes).
#   bash scripts/gpu_elastic.sh            logs and JSON under ${OUT:-/tmp/kvcore-gpu}
# 1. GPU tests: CUDA VMM grow/shrink in place (bytes, addresses, zeroed new blocks, memory given
#    back per mem_get_info), a CUDA graph replayed across a grow, a NIXL registration made before
#    a grow (skipped without nixl), kvcore.hf.Engine on an elastic cache with decode graphs.
# 2. kvcore bench elastic --measure: per-layout growth cost for llama-3-8b at the device's granule;
#    commit/release time per 2 MiB granule and per GiB (target <= 1 ms per granule); memory the
#    device reports back after the release; grow 2 -> 2048 blocks (4 GiB) and back per layout.
# 3. Triton decode bandwidth over an elastic cache vs a plain allocation, every layout (>= 0.97x).
# 4. examples/elastic.py: two engines taking turns with the memory (timeline).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:tests:plugins/kvcore-torch:plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
$PY -c "import cuda.bindings.driver as d; print('cuda-bindings OK')" 2>&1 | tail -1 \
  || echo "cuda-bindings missing: pip install 'kvcore[elastic]' (the GPU path cannot run)"
echo "== 1. GPU tests (tests/test_elastic_gpu.py)"
timeout 110 $PY -m pytest -q -rs -p no:cacheprovider tests/test_elastic_gpu.py 2>&1 | tee "$OUT/elastic_gpu_tests.txt" | tail -15
echo "== 2. kvcore bench elastic --measure (llama-3-8b, 2048 blocks reserved, 1 GiB commits)"
timeout 60 $PY -m kvcore bench elastic --measure --max-blocks 2048 --gib 1 --json > "$OUT/bench_elastic.json" 2> "$OUT/bench_elastic.err"
echo "rc=$? (json in $OUT/bench_elastic.json)"; tail -3 "$OUT/bench_elastic.err"
$PY - "$OUT/bench_elastic.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"no bench result: {exc}")
for row in r["layouts"]:
    print(f"  {row['layout']:6} granules/block {row['granules_per_block']:6.1f}  maps/grow {row['mappings_per_grow_event']:6.1f}"
          f"  blocks/grow {row['blocks_per_grow_event']:7.1f}  max slack {row['max_slack_bytes'] / 2**20:7.1f} MiB")
b = r["backing"]
print(f"  granule {b['granularity'] >> 20} MiB: commit {b['commit_granule_ms']:.3f} ms, release {b['release_granule_ms']:.3f} ms"
      f" per granule (target <= 1 ms: {'MET' if max(b['commit_granule_ms'], b['release_granule_ms']) <= 1 else 'MISSED'});"
      f" {b['commit_gib_ms']:.1f} / {b['release_gib_ms']:.1f} ms per GiB;"
      f" device memory given back {b['returned_bytes'] / 2**30:.3f} of {b['held_grown_bytes'] / 2**30:.3f} GiB")
for row in r["resize"]:
    if "refused" in row:
        print(f"  {row['layout']:6} refused: {row['refused']}"); continue
    print(f"  {row['layout']:6} grow 2 -> 2048: {row['granules']} granules in {row['grow_ms']:.1f} ms"
          f" ({row['grow_ms_per_granule']:.3f} ms/granule), shrink {row['shrink_ms']:.1f} ms ({row['shrink_ms_per_granule']:.3f} ms/granule)")
PY
echo "== 3. decode bandwidth, elastic vs plain (64 x 4096 tokens, GQA 32/8, head 128, bf16, 4 layers)"
timeout 120 $PY scripts/gpu_elastic_decode.py --iters 20 --rounds 2 --json "$OUT/elastic_decode.json" 2>&1 | tee "$OUT/elastic_decode.txt" | tail -8
echo "== 4. examples/elastic.py (two engines, one GPU)"
timeout 90 $PY examples/elastic.py --device cuda --rounds 2 --requests 16 --prompt-len 1000 --max-new-tokens 16 \
  2>&1 | tee "$OUT/elastic_example.txt" | grep -v Warning | tail -40
