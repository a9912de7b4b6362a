#!/usr/bin/env bash
# Sixth session's GPU check of main after the third #23 round (repository root, one H200).
#   PART=suite bash scripts/gpu_session6.sh   the whole suite (tests, plugins, benchmarks) with CUDA
#                                              and the interpreter off, then the graphed
#                                              `kvcore bench hf` row and hybrid exactness
#   PART=paths bash scripts/gpu_session6.sh   the GPU-only paths the round touched: each area's
#                                              GPU script that exists, and CudaBacking
#   PART=bench bash scripts/gpu_session6.sh   every benchmark's CUDA run through the kvcore.cli
#                                              entry point (scripts/gpu_bench.sh, SKIP_TESTS=1)
# NIXL from .whl/ (scripts/_nixl_env.sh). Logs under ${OUT:-/tmp/kvcore-gpu6}; each step is capped.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu6}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$SECONDS; BUDGET=${BUDGET:-570}
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton \
  -e plugins/kvcore-flashinfer >>"$OUT/pip.txt" 2>&1 || echo "plugin installs failed (see pip.txt)"
export PYTHONPATH=$PWD:$PWD/tests:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer
source scripts/_nixl_env.sh
source scripts/_bench_env.sh
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), 'torch', torch.__version__, 'triton', triton.__version__)"
step() {  # step NAME TIMEOUT CMD...: run while time is left, log to $OUT/NAME.txt, show its tail
  local name=$1 limit=$2; shift 2
  local rest=$((BUDGET - (SECONDS - START)))
  if [ "$rest" -lt 15 ]; then echo "== $name: SKIPPED (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s (cap ${limit}s)" | tee -a "$OUT/summary.txt"
  grep -v -E "Warning|warn\(|NIXL INFO|falling back" "$OUT/$name.txt" | tail -n "${TAIL:-6}"
}
T="$PY -m pytest -q -rs -p no:cacheprovider"
case ${PART:-suite} in
suite)
  TAIL=25 step suite 430 $T tests plugins benchmarks
  TAIL=14 step bench_hf 80 $PY -m kvcore bench hf --backend auto --layers 8 --requests 64 \
    --skip eager,generate_batch,static,check,profile,prefix --json-out "$OUT/bench_hf.json"
  step hybrid_exact 50 $PY scripts/gpu_hybrid_check.py "$OUT/hybrid_exact.json" ;;
paths)
  TAIL=4 step cuda_backing 60 bash -c 'sed -n "/^timeout 60/,/^PY$/p" scripts/gpu_memspecs.sh | sed "1d;\$d" | '"$PY"' -'
  for s in ${AREAS:-scripts/gpu_transfer3.sh scripts/gpu_hf3.sh scripts/gpu_memory3.sh scripts/gpu_runtime.sh}; do
    [ -f "$s" ] || continue
    n=$(basename "$s" .sh); TAIL=12 step "$n" 240 env OUT="$OUT/$n" bash "$s"
  done
  if [ -n "${BEFORE:-}" ]; then  # the zeroer's host us per call, before/after alternating 3 times
    PLUG=plugins/kvcore-torch:plugins/kvcore-triton
    for i in 1 2 3; do for tree in before=$BEFORE after=$PWD; do
      root=${tree#*=}; PYTHONPATH=$root:$root/${PLUG/:/:$root/} timeout 60 $PY \
        scripts/gpu_zeroer_probe.py --label "${tree%%=*}" | tee -a "$OUT/zeroer_host_us.jsonl"
    done; done
  fi ;;
bench)
  TAIL=60 step bench 540 env SKIP_TESTS=1 bash scripts/gpu_bench.sh ;;
esac
echo "== total $((SECONDS - START))s"; cat "$OUT/summary.txt"
