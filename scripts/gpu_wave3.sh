#!/usr/bin/env bash
# The third wave's GPU figures in one lease (repository root, one CUDA GPU, < 9 minutes), most
# important first, every step capped: the elastic cache on CUDA virtual memory, hybrid exactness,
# FlashInfer decode through kvcore's views vs its own tensor, the default engine's first and second
# generate, the hybrid engine row, elastic decode bandwidth, FlashInfer engine tokens vs torch
# (triton as the control). Wheels from .whl/ (scripts/trim_flashinfer_wheel.py's FlashInfer,
# apache-tvm-ffi, cuda-tile; scripts/trim_nixl_wheel.py's NIXL). Logs under ${OUT:-/tmp/kvcore-gpu}.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$(date +%s); BUDGET=${BUDGET:-530}
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1 \
  || echo "wheel install failed (see pip.txt)"
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton \
  -e plugins/kvcore-flashinfer >>"$OUT/pip.txt" 2>&1 || echo "plugin installs failed (see pip.txt)"
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
command -v ninja >/dev/null || export PATH=/tmp/site/bin:$PATH
: >"$OUT/summary.txt"
step() {  # step NAME TIMEOUT CMD...: run while time is left, log to $OUT/NAME.txt, show its tail
  local name=$1 limit=$2; shift 2
  local rest=$((BUDGET - ($(date +%s) - START)))
  if [ "$rest" -lt 15 ]; then echo "== $name: SKIPPED (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s (cap ${limit}s)" | tee -a "$OUT/summary.txt"
  grep -v -E "Warning|warn\(|falling back" "$OUT/$name.txt" | tail -n "${TAIL:-12}"
}
HF="--layers 8 --requests 64 --shared-prefix 0 --skip eager,generate_batch,static,prefix,check,profile"
TAIL=20 step elastic_tests 75 $PY -m pytest -q -rs -p no:cacheprovider tests/test_elastic_gpu.py
TAIL=8 step elastic_bench 40 $PY -m kvcore bench elastic --measure --max-blocks 2048 --gib 1
TAIL=12 step hybrid_exact 55 $PY scripts/gpu_hybrid_check.py "$OUT/hybrid_exact.json"
TAIL=24 step fi_decode 80 $PY plugins/kvcore-triton/bench_decode.py --flashinfer --block-size 16,64 \
  --layouts LBNHC,LBHNC,BLNHC --skip-torch-check --iters 30
TAIL=10 step hf_auto 50 $PY -m kvcore bench hf --backend auto $HF
TAIL=16 step hf_hybrid 65 $PY -m kvcore bench hf --model hybrid --backend triton --dtype bfloat16 \
  --hidden 1536 --intermediate 4096 --layers 16 --heads 24 --kv-heads 8 --vocab 32000 --requests 32 \
  --prompt-len 256 --new-tokens 64 --shared-prefix 0 --block-size 64 --check-requests 8 \
  --check-prompt-len 64 --check-new-tokens 16
TAIL=12 step elastic_decode 60 $PY scripts/gpu_elastic_decode.py --iters 20 --rounds 2
TAIL=6 step fi_engine 130 $PY scripts/gpu_flashinfer_engine.py llama
echo "== total $(( $(date +%s) - START ))s"; cat "$OUT/summary.txt"
