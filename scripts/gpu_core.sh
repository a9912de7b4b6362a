#!/usr/bin/env bash
# Issue #23 shrink round, helper 'core' (runtime/ without zeroer/, specs/, model_runner/, top-level
# modules): the GPU tests that run through the rewritten BlockPool (one reference table, one pending
# set), AttentionGroup (a read-only view of its record) and KVCache.create, with CUDA present and the
# Triton interpreter off. About 4 minutes on one H200. Nothing here is a benchmark.
#   1. CUDA-graph decode through AttentionGroup.map_to_kernel_block_table (persistent kernel table).
#   2. Zeroer and KVCache.begin_step on CUDA views (KVCache.create wires zeroer from the record).
#   3. Elastic KVCache.resize on CUDA (BlockPool.resize shares the constructor's size check).
#   4. The runtime, negotiation and engine-loop tests (CPU cases through the Triton interpreter).
# Run from the repository root: bash scripts/gpu_core.sh   (logs under ${OUT:-/tmp/kvcore-gpu-core})
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu-core}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
status=0
run() {  # run NAME TIMEOUT TEST_PATHS...: one pytest run, its skips/failures and a verdict
  local name=$1 limit=$2; shift 2
  echo; echo "== $name"
  timeout "$limit" $PY -m pytest -q -rs -p no:cacheprovider "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/$name.txt" | head -8; tail -1 "$OUT/$name.txt"
  if [ $rc = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $rc, log $OUT/$name.txt)"; status=1; fi
}

$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA: every step below skips')"

run 1-cuda-graph-decode 150 tests/test_cuda_graph_decode.py plugins/kvcore-triton/tests/test_cuda_graph.py
run 2-zeroer-on-cuda 150 tests/test_zeroer_gpu.py
run 3-elastic-on-cuda 150 tests/test_elastic_gpu.py
TRITON_INTERPRET=1 run 4-runtime 200 tests/test_runtime.py tests/test_negotiation.py tests/test_engine_loop.py \
  tests/test_attn_group.py tests/test_attn_group_record.py tests/test_block_pool.py
echo; if [ $status = 0 ]; then echo "gpu_core: ALL PASS"; else echo "gpu_core: SOME FAILED (logs in $OUT)"; fi
exit $status
