#!/usr/bin/env bash
# Fourth session's GPU check of main after the #23 shrink round and the NIXL prepared lists, one
# H200 call (< 10 minutes, every step capped, most important first): the GPU tests of every area
# (zeroer, elastic, NIXL, CUDA-graph decode, the HF engine with the one step builder), planning and
# allocating every layout on CUDA, the bench hf kvcore row (graph steps must replay), hybrid
# exactness, tensor parallelism on one GPU. NIXL from .whl/. Logs under ${OUT:-/tmp/kvcore-gpu4}.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu4}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$SECONDS; BUDGET=${BUDGET:-570}
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton \
  -e plugins/kvcore-flashinfer >>"$OUT/pip.txt" 2>&1 || echo "plugin installs failed (see pip.txt)"
export PYTHONPATH=$PWD:$PWD/tests:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer
source scripts/_nixl_env.sh
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
: >"$OUT/summary.txt"
step() {  # step NAME TIMEOUT CMD...: run while time is left, log to $OUT/NAME.txt, show its tail
  local name=$1 limit=$2; shift 2
  local rest=$((BUDGET - (SECONDS - START)))
  if [ "$rest" -lt 15 ]; then echo "== $name: SKIPPED (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s (cap ${limit}s)" | tee -a "$OUT/summary.txt"
  grep -v -E "Warning|warn\(|NIXL INFO|falling back" "$OUT/$name.txt" | grep -E "passed|failed|FAILED|ERROR|Error|ok|OK|tok/s|graph" | tail -n "${TAIL:-8}"
}
T="$PY -m pytest -q -rs -p no:cacheprovider"
step core_gpu_tests 150 $T tests/test_zeroer_gpu.py tests/test_elastic_gpu.py tests/test_nixl_gpu.py tests/test_nixl.py \
  tests/test_cuda_graph_decode.py tests/test_runtime.py tests/test_memory.py tests/test_negotiation.py \
  tests/test_kernel_requirements.py tests/test_host_pool.py benchmarks/tests/test_transfer_bench.py benchmarks/tests/test_bench_zero.py
step hf_gpu_tests 170 $T tests/test_hf_engine.py tests/test_hf_defaults.py tests/test_hf_faults.py \
  tests/test_hf_elastic.py tests/test_engine_loop.py plugins/kvcore-flashinfer/tests/test_flashinfer_fake.py
TAIL=4 step mem_allocate 60 bash -c 'sed -n "/^timeout 120/,/^PY$/p" scripts/gpu_mem.sh | sed "1d;\$d" | '"$PY"' -'
TAIL=14 step bench_hf 90 $PY -m kvcore bench hf --backend auto --layers 8 --requests 64 \
  --skip eager,generate_batch,static,check,profile,prefix --json-out "$OUT/bench_hf.json"
step hybrid_exact 50 $PY scripts/gpu_hybrid_check.py "$OUT/hybrid_exact.json"
step tp 90 $T tests/test_distributed.py tests/test_hf_tp.py
echo "== total $((SECONDS - START))s"; cat "$OUT/summary.txt"
cd "$OUT" && tar czf gpu4.tgz *.txt *.json 2>/dev/null; ls
