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
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/pip.txt" 2>&1 \
  || { echo "wheel install failed:"; tail -3 "$OUT/pip.txt"; }
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-flashinfer -e plugins/kvcore-triton \
  -e plugins/kvcore-torch >>"$OUT/pip.txt" 2>&1 || {
  echo "editable installs failed; writing entry-point stubs into /tmp/site"
  for p in torch triton flashinfer; do
    d=/tmp/site/kvcore_$p-0.1.0.dist-info; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: kvcore-%s\nVersion: 0.1.0\n' "$p" >"$d/METADATA"
    printf '[kvcore.plugins]\n%s = kvcore_%s.plugin\n' "$p" "$p" >"$d/entry_points.txt"
  done; }
command -v ninja >/dev/null || export PATH=/tmp/site/bin:$PATH
step import 90 $PY -c "
import time, torch; t = time.time(); import flashinfer
print('flashinfer', flashinfer.__version__, 'imported in %.1f s' % (time.time() - t), '| torch', torch.__version__,
      'CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())
import kvcore; spec = kvcore.FullAttentionSpec(16, 8, 128, torch.bfloat16)
print('auto on cuda ->', kvcore.select_backend(spec, 'cuda').name)"
step plugins 60 $PY -m kvcore plugins
# 2. Decode: FlashInfer through kvcore's views vs its own contiguous paged tensor, kvcore-triton, SDPA.
step bench_decode 120 $PY plugins/kvcore-flashinfer/bench_flashinfer_decode.py --json-out "$OUT/bench_decode.json"
# 3. Engine tokens against the torch backend (compiles the prefill module: ~90 s the first time).
step engine_agreement 200 $PY scripts/gpu_flashinfer_engine.py llama gemma3 --json-out "$OUT/engine_agreement.json"
# 4. kvcore bench hf: auto vs flashinfer vs triton, first vs second generate.
HF="--layers 8 --requests 64 --shared-prefix 0 --skip eager,generate_batch,static,prefix,check,profile"
for b in auto flashinfer triton; do
  step bench_hf_$b 100 $PY -m kvcore bench hf --backend $b $HF --json-out "$OUT/bench_hf_$b.json"
done
# 5. The backend test kit against the float64 reference (every layout, splits, windows, graphs).
step gpu_tests 200 $PY -m pytest -q -rs -x -p no:cacheprovider plugins/kvcore-flashinfer/tests -k "not head_sizes"
# 6. The runnable example over every layout FlashInfer accepts.
for layout in LBNHC LBHNC BLNHC BLHNC BHLNC LHBNC; do
  TAIL=3 step run_decode_$layout 40 $PY examples/run_decode.py --backend flashinfer --layout $layout --dtype bfloat16
done
# 7. Other head sizes and fp16 (one JIT build each): last, while time is left.
step gpu_tests_head_sizes 150 $PY -m pytest -q -rs -p no:cacheprovider plugins/kvcore-flashinfer/tests -k head_sizes
echo "== summary (total $(( $(date +%s) - START ))s)"; cat "$OUT/summary.txt"
