#!/usr/bin/env bash
# Issue #23 items 4-5 (kvcore/hf simplified), helper 'hfpath': what only a CUDA machine checks
# (about 4 minutes on one H200, every step capped; logs under ${OUT:-/tmp/kvcore-gpu-hfpath}).
#   1. The hf tests on CUDA with the interpreter off: token equality with model.generate on the
#      Triton backend, CUDA-graph decode steps (DecodeGraphs reads Scheduler.tables, the one home
#      of block ids now), graphs captured when the engine is built, prefix caching / disagg,
#      elastic engines (tests/test_elastic_gpu.py), the scheduler's property test.
#   2. `kvcore bench hf` (kvcore row + the prefix-caching run only): the engine still serves, the
#      prefix path (PrefixSharing.hit, enable_prefix_caching on KVCache.create) still hits; compare
#      its tok/s with BENCHMARKS.md's kvcore row of the same shape (no regression expected: the
#      step builder and the graphs did not change).
# Run from the repository root: bash scripts/gpu_hfpath.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu-hfpath}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer${PYTHONPATH:+:$PYTHONPATH}
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }

$PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"

step "1. hf tests on CUDA (interpreter off)"
timeout -k 5 200 $PY -m pytest -q -rs -p no:cacheprovider tests/test_hf_engine.py tests/test_hf_defaults.py \
  tests/test_hf_disagg.py tests/test_hf_elastic.py tests/test_hf_scheduler.py tests/test_elastic_gpu.py \
  plugins/kvcore-flashinfer/tests/test_flashinfer_fake.py >"$OUT/tests.txt" 2>&1
rc=$?; grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/tests.txt" | head -12; tail -2 "$OUT/tests.txt"; verdict $rc "$OUT/tests.txt"

step "2. kvcore bench hf: kvcore and prefix-caching rows (8 layers, 64 requests)"
timeout -k 5 150 $PY -m kvcore bench hf --backend auto --layers 8 --requests 64 --shared-prefix 512 \
  --skip eager,generate_batch,static,check,profile >"$OUT/bench_hf.txt" 2>&1
rc=$?; grep -v -E "Warning|warn\(" "$OUT/bench_hf.txt" | tail -14; verdict $rc "$OUT/bench_hf.txt"

echo; [ $status = 0 ] && echo "gpu_hfpath: ALL PASS" || echo "gpu_hfpath: SOME STEP FAILED (logs in $OUT)"
exit $status
