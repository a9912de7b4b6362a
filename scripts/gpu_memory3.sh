#!/usr/bin/env bash
# memory/specs shrink, round 3 (issue 23): GPU check of what changed on the CUDA path (repo root;
# under 3 minutes). No GPU-only code changed (backing_cuda.py: its module docstring only), but
# KVCache.create(..., max_num_blocks=M) now takes the reservation from reserve_elastic(...).backing
# and max_num_blocks from the plan: tests/test_elastic_gpu.py runs that path on CUDA.
#   bash scripts/gpu_memory3.sh       logs under ${OUT:-/tmp/kvcore-gpu}
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:tests:plugins/kvcore-torch:plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
$PY -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
echo "== elastic caches on CUDA (grow/shrink keep bytes and addresses, graphs, engine tokens)"
timeout 170 $PY -m pytest -q -p no:cacheprovider tests/test_elastic_gpu.py 2>&1 | tee "$OUT/memory3_elastic_gpu.txt" | tail -15
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && grep -q " passed" "$OUT/memory3_elastic_gpu.txt"; then
  echo "memory3: PASS ($(tail -1 "$OUT/memory3_elastic_gpu.txt"); a skip names what is not installed)"
else
  echo "memory3: FAIL (rc=$rc; 124 means it ran past 170 s; see $OUT/memory3_elastic_gpu.txt)"
fi
