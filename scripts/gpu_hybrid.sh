#!/usr/bin/env bash
# Hybrid models (Mamba2 / short-convolution mixers + attention) on one CUDA GPU, < 2 minutes:
#   1. float32 tokens equal model.generate for Bamba, GraniteMoeHybrid (MoE, dense), FalconH1, Qwen3-Next,
#      NemotronH and LFM2 with the triton and torch backends; bf16 state specs equal transformers' cache.
#   2. kvcore bench hf --model hybrid: a Granite-4.0-H-like random model (bf16, Triton attention,
#      16 layers, 2 of them attention) against one static batched model.generate, then its own
#      float32 token check on the GPU.
# Logs and JSON go to ${OUT:-/tmp/kvcore-gpu-hybrid}; a summary is printed at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu-hybrid}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
START=$(date +%s)
: >"$OUT/summary.txt"
step() {  # step NAME TIMEOUT CMD...: log to $OUT/NAME.txt, show its tail, record rc and seconds
  local name=$1 limit=$2; shift 2
  echo "== $name (timeout ${limit}s)"
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1; local rc=$?
  grep -v "falling back to its reference" "$OUT/$name.txt" | tail -n "${TAIL:-30}"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
}
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
TAIL=20 step exactness 50 $PY scripts/gpu_hybrid_check.py "$OUT/exactness.json"
step bench_hf_hybrid 65 $PY -m kvcore bench hf --model hybrid --backend triton --dtype bfloat16 \
  --hidden 1536 --intermediate 4096 --layers 16 --heads 24 --kv-heads 8 --vocab 32000 \
  --requests 32 --prompt-len 256 --new-tokens 64 --shared-prefix 0 --block-size 64 \
  --check-requests 8 --check-prompt-len 64 --check-new-tokens 16 --json-out "$OUT/bench_hf_hybrid.json"
echo "== summary (total $(( $(date +%s) - START ))s; rc=0 everywhere means every check passed)"
cat "$OUT/summary.txt"
