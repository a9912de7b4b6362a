#!/usr/bin/env bash
# kvcore-flashinfer on one CUDA GPU, most important figures first, < 9 minutes with FlashInfer's JIT
# (decode ~15 s, prefill ~86 s per dtype/head/window combination, nothing cached between leases).
# FlashInfer comes from the wheels in .whl/ (scripts/trim_flashinfer_wheel.py's trimmed
# flashinfer-python, apache-tvm-ffi, cuda-tile). Every step has its own timeout and a deadline
# check; logs and JSON go to ${OUT:-/tmp/kvcore-gpu}; a summary is printed at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$(date +%s); BUDGET=${BUDGET:-520}
export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer${PYTHONPATH:+:$PYTHONPATH}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # step NAME TIMEOUT CMD...: run when time is left, log to $OUT/NAME.txt, show its tail
  local name=$1 limit=$2; shift 2
  local rest; rest=$(left)
  if [ "$rest" -lt 20 ]; then echo "== $name: SKIPPED (deadline)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  echo "== $name (timeout ${limit}s, t=$(( $(date +%s) - START ))s)"
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1; local rc=$?
  tail -n "${TAIL:-14}" "$OUT/$name.txt"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
}
: >"$OUT/summary.txt"
# 1. FlashInfer from the carried wheels; the plugins' entry points (editable installs, else dist-info stubs).
shopt -s nullglob
WHEELS=(.whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl .whl/cuda_tile-*.whl .whl/ninja-*.whl)
echo "wheels: ${WHEELS[*]:-NONE (expected in .whl/)}"
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS[@]}" >"$OUT/pip.txt" 2>&1 \
  || { echo "wheel install failed:"; tail -3 "$OUT/pip.txt"; }
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-flashinfer -e plugins/kvcore-triton \
  -e plugins/kvcore-torch >>"$OUT/pip.txt" 2>&1 || {
  echo "editable installs failed; writing entry-point stubs into /tmp/site"
  for p in torch triton flashinfer; do
    d=/tmp/site/kvcore_$p-0.1.0.dist-info; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: kvcore-%s\nVersion: 0.1.0\n' "$p" >"$d/METADATA"
    printf '[kvcore.plugins]\n%s = kvcore_%s.plugin\n' "$p" "$p" >"$d/entry_points.txt"
  done; }
# FlashInfer's JIT runs `ninja` from PATH: the carried ninja wheel's when the machine has none.
command -v ninja >/dev/null || export PATH=/tmp/site/bin:$PATH
echo "ninja: $(command -v ninja || echo MISSING)  nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo MISSING)"
step import 90 $PY -c "
import time, torch; t = time.time(); import flashinfer
print('flashinfer', flashinfer.__version__, 'imported in %.1f s' % (time.time() - t), '| torch', torch.__version__,
      'CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())
import kvcore; spec = kvcore.FullAttentionSpec(16, 8, 128, torch.bfloat16)
print('auto on cuda ->', kvcore.select_backend(spec, 'cuda').name)"
step plugins 60 $PY -m kvcore plugins
# 2. Decode: FlashInfer through kvcore's views vs its own contiguous paged tensor, kvcore-triton, SDPA.
# (64 x 4,096 tokens, GQA 32/8, head 128, bf16; kernel blocks 16 and 64; JSON in bench_decode.txt's last line.)
TAIL=20 step bench_decode 150 $PY plugins/kvcore-triton/bench_decode.py --flashinfer --block-size 16,64 \
  --layouts LBNHC,LBHNC,BLNHC --skip-torch-check --iters 30 --json
# 3. Engine tokens against the torch backend on Llama (compiles the prefill module: ~90 s the first time).
step engine_llama 170 $PY scripts/gpu_flashinfer_engine.py llama --json-out "$OUT/engine_llama.json"
# 4. kvcore bench hf: auto vs flashinfer vs triton, first vs second generate.
# Heads 16/4 of 128 (hidden 2048): the head size FlashInfer's modules were built for above.
HF="--layers 8 --heads 16 --kv-heads 4 --requests 64 --shared-prefix 0 --skip eager,generate_batch,static,prefix,check,profile"
for b in auto flashinfer triton; do
  TAIL=22 step bench_hf_$b 100 $PY -m kvcore bench hf --backend $b $HF --json-out "$OUT/bench_hf_$b.json"
done
# 5. Gemma 3 (sliding + full layers: the windowed modules, ~100 s of JIT).
step engine_gemma3 170 $PY scripts/gpu_flashinfer_engine.py gemma3 --json-out "$OUT/engine_gemma3.json"
# 6. The backend test kit against the float64 reference (every layout, splits, windows, graphs), and
#    the engine's decode graphs captured when it is built.
step gpu_tests 200 $PY -m pytest -q -rs -p no:cacheprovider plugins/kvcore-flashinfer/tests tests/test_hf_defaults.py \
  -k "not head_sizes"
# 7. The runnable example over every layout FlashInfer accepts (head 128, windowed odd layers).
for layout in LBNHC LBHNC BLNHC BLHNC BHLNC LHBNC; do
  TAIL=3 step run_decode_$layout 40 $PY examples/run_decode.py --backend flashinfer --layout $layout \
    --head-size 128 --hybrid
done
# 8. Other head sizes and fp16 (one JIT build each): last, while time is left.
step gpu_tests_head_sizes 150 $PY -m pytest -q -rs -p no:cacheprovider plugins/kvcore-flashinfer/tests -k head_sizes
echo "== summary (total $(( $(date +%s) - START ))s)"; cat "$OUT/summary.txt"
