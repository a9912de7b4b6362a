#!/usr/bin/env bash
# NIXL on one CUDA GPU, in one go: the NIXL tests on CUDA tensors (two agents, host<->device,
# two processes on one GPU) and `kvcore bench transfer`'s NIXL loopback rows (VRAM and DRAM).
# Run from the repository root on a CUDA machine. NIXL comes from wheels in .whl/ when it does
# not import: the `nixl` selector package and a trimmed nixl-cu12/-cu13 wheel matching torch's
# CUDA (made with scripts/trim_nixl_wheel.py; the lent H200's torch 2.11 is CUDA 13: nixl-cu13).
# Logs and JSON go to ${OUT:-/tmp/kvcore-gpu}.
#   bash scripts/gpu_nixl.sh                      # tests, then the benchmark's NIXL rows
#   bash scripts/gpu_nixl.sh rows [bench options] # only scripts/gpu_nixl_rows.py, layout by layout
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-.:plugins/kvcore-torch:plugins/kvcore-triton}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
if ! $PY -c "import nixl._api" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nixl-site .whl/nixl-*.whl .whl/nixl_cu*.whl \
    || { echo "no NIXL wheels in .whl/"; exit 1; }
  export PYTHONPATH=/tmp/nixl-site:$PYTHONPATH
fi
# UCX's CUDA module needs libcudart of torch's CUDA major; torch's wheels keep it under nvidia/.
CUDART_DIR=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
c = sorted(glob.glob(d + '/nvidia/**/libcudart.so.' + torch.version.cuda.split('.')[0], recursive=True)); print(os.path.dirname(c[0]) if c else '')")
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR:${LD_LIBRARY_PATH:-}
if [ "${1:-}" = rows ]; then
  shift; $PY scripts/gpu_nixl_rows.py "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/rows.txt"; exit
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . -e plugins/kvcore-torch -e plugins/kvcore-triton >"$OUT/pip.txt" 2>&1 \
  || { echo "editable install failed (PYTHONPATH is used instead):"; tail -3 "$OUT/pip.txt"; }
$PY - <<'EOF'
import platform, torch, nixl
print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name(), "x", torch.cuda.device_count(), "| NIXL from", nixl._pkg.__name__)
EOF
echo "== kvcore bench transfer: NIXL loopback in VRAM"
timeout 70 $PY -m kvcore bench transfer --no-host --nixl-memory VRAM --nixl-blocks ${VRAM_BLOCKS:-16,128,512} \
  --json-out "$OUT/bench_nixl_vram.json" 2>&1 | tee "$OUT/bench_vram.txt" | grep -v "NIXL INFO" | tail -16
echo "== NIXL tests on CUDA tensors"
timeout 100 $PY -m pytest -q -rs -p no:cacheprovider tests/test_nixl_gpu.py benchmarks/tests/test_transfer_bench.py tests/test_nixl.py \
  2>&1 | tee "$OUT/nixl_tests.txt" | grep -v "NIXL INFO" | tail -15
echo "== kvcore bench transfer: NIXL loopback in DRAM"
timeout 40 $PY -m kvcore bench transfer --no-host --nixl-memory DRAM --nixl-blocks ${DRAM_BLOCKS:-16,128} \
  --json-out "$OUT/bench_nixl_dram.json" 2>&1 | grep -v "NIXL INFO" | tail -12
