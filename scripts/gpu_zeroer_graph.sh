#!/usr/bin/env bash
# The zeroer host path, the one-block device ratio and the CUDA-graph decode step, in one go
# (repository root, one CUDA GPU). Logs and JSON go to ${OUT:-/tmp/kvcore-gpu}.
#   bash scripts/gpu_zeroer_graph.sh
# Wheels under .whl/ (e.g. xxhash for a machine without it) are installed first when present.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:plugins/kvcore-torch:plugins/kvcore-triton
unset KVCORE_DEBUG_CHECKS KVCORE_ZEROER_STAGING
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import xxhash" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_zeroer_gpu.py tests/test_cuda_graph_decode.py \
  tests/test_backends_no_sync.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
echo "== host us per call"
timeout 150 $PY scripts/zeroer_host_us.py --json-out "$OUT/host_us.json" 2>&1 | tail -40
echo "== kvcore bench zero"
timeout 200 $PY -m kvcore bench zero --json-out "$OUT/bench_zero.json" 2>&1 | tail -30
echo "== Triton backend tests on CUDA"
timeout 100 $PY -m pytest -q -rs -x -p no:cacheprovider plugins/kvcore-triton/tests/test_triton_backend.py 2>&1 | tee "$OUT/triton_tests.txt" | tail -8
