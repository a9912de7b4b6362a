#!/usr/bin/env bash
# Fifth session's GPU check of main after the second #23 shrink round (repository root, one H200).
#   PART=suite bash scripts/gpu_session5.sh   the whole test suite with CUDA, interpreter off, then the
#                                              graphed `kvcore bench hf` row and hybrid exactness
#   PART=paths bash scripts/gpu_session5.sh   the GPU-only paths the round touched: CudaBacking
#                                              (scripts/gpu_memspecs.sh) and every benchmark's CUDA run
#                                              (scripts/gpu_bench.sh, NIXL rows included)
#   PART=tp    bash scripts/gpu_session5.sh   two GPUs: tests/test_distributed.py and tests/test_hf_tp.py
# NIXL from .whl/ (scripts/_nixl_env.sh). Logs under ${OUT:-/tmp/kvcore-gpu5}; each step is capped.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu5}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$SECONDS; BUDGET=${BUDGET:-570}
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton \
  -e plugins/kvcore-flashinfer >>"$OUT/pip.txt" 2>&1 || echo "plugin installs failed (see pip.txt)"
export PYTHONPATH=$PWD:$PWD/tests:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer
source scripts/_nixl_env.sh
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
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
  TAIL=25 step suite 420 $T tests plugins
  TAIL=14 step bench_hf 80 $PY -m kvcore bench hf --backend auto --layers 8 --requests 64 \
    --skip eager,generate_batch,static,check,profile,prefix --json-out "$OUT/bench_hf.json"
  step hybrid_exact 50 $PY scripts/gpu_hybrid_check.py "$OUT/hybrid_exact.json" ;;
paths)
  TAIL=4 step cuda_backing 60 bash -c 'sed -n "/^timeout 60/,/^PY$/p" scripts/gpu_memspecs.sh | sed "1d;\$d" | '"$PY"' -'
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashinfer_python-*.whl \
    .whl/apache_tvm_ffi-*.whl .whl/cuda_tile-*.whl .whl/ninja-*.whl >>"$OUT/pip.txt" 2>&1
  step flashinfer_gpu 200 env PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH $T \
    plugins/kvcore-flashinfer/tests/test_flashinfer_gpu.py
  TAIL=60 step bench 300 env SKIP_TESTS=1 bash scripts/gpu_bench.sh ;;  # its tests ran in PART=suite
tp)
  step tp 300 $T tests/test_distributed.py tests/test_hf_tp.py ;;
esac
echo "== total $((SECONDS - START))s"; cat "$OUT/summary.txt"
