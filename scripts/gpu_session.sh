#!/usr/bin/env bash
# Everything that needs a GPU, in one go (run from the repository root on a CUDA machine;
# the TP step needs 2 GPUs). Logs and JSON go to ${OUT:-/tmp/kvcore-gpu}.
#   bash scripts/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python}
$PY -m pip install -q --no-deps --no-build-isolation -e . -e plugins/kvcore-torch -e plugins/kvcore-triton >"$OUT/pip.txt" 2>&1 || tail -5 "$OUT/pip.txt"
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), 'torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider plugins tests/test_zeroer_gpu.py tests/test_zeroer.py \
  tests/test_runtime.py tests/test_engine_loop.py tests/test_distributed.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
echo "== demo on CUDA"
for a in "" "--block-size 128" "--hybrid --layout BLNHC" "--no-check --num-seqs 256 --max-num-seqs 32 --num-blocks 2000 --token-budget 512"; do
  echo "-- run_decode.py $a"; timeout 120 $PY examples/run_decode.py $a 2>&1 | tail -3
done
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "== TP on 2 GPUs"; timeout 120 torchrun --standalone --nproc-per-node 2 examples/tp_decode.py 2>&1 | grep -E "ranks|error|OK|FAIL"
fi
echo "== kvcore bench zero"; timeout 200 $PY -m kvcore bench zero --json-out "$OUT/bench_zero.json" 2>&1 | tail -40
echo "== decode bench (default kernel config)"
timeout 200 $PY plugins/kvcore-triton/bench_decode.py --block-size 16,64 2>&1 | tee "$OUT/bench_decode.txt" | tail -12
