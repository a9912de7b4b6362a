#!/usr/bin/env bash
# Issue #23 (shrink), helper 'cli': what only a CUDA machine checks of the command line and the
# benchmarks after their rewrite (about 4 minutes on one H200).
#   1. The command-line and benchmark tests with CUDA present.
#   2. kvcore bench hf --device cuda:<one past the last GPU>: usage error, exit 2, no traceback.
#   3. kvcore bench zero with its defaults (what BENCHMARKS.md compares): JSON and tables; the
#      memset column must be found (cudaMemsetAsync), every row timed, tables within 80 columns.
#   4. A small kvcore bench hf on CUDA: eager and graphed engine, prefix caching off/on and the
#      float32 check (exit 0 only when the check's tokens match), output within 80 columns.
#   5. kvcore bench elastic --measure on CUDA (grow / shrink through the backing memory).
# Run from the repository root: bash scripts/gpu_cli.sh   (logs under ${OUT:-/tmp/kvcore-gpu-cli})
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= COLUMNS=80
OUT=${OUT:-/tmp/kvcore-gpu-cli}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }
wide() { $PY -c "import sys; print(sum(len(l.rstrip(chr(10))) > 80 for l in open(sys.argv[1])))" "$1"; }

$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, \
'|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"

step "1. command-line and benchmark tests with CUDA present"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cli.py tests/test_cli_plan.py \
  tests/test_cli_plugins.py benchmarks/tests/test_bench_zero.py benchmarks/tests/test_bench_plan.py benchmarks/tests/test_bench_hf_cli.py \
  benchmarks/tests/test_prefix_caching_bench.py >"$OUT/cli_tests.txt" 2>&1
rc=$?; tail -4 "$OUT/cli_tests.txt"; verdict $rc "$OUT/cli_tests.txt"

step "2. bench hf --device cuda:<one past the last GPU> is a usage error"
N=$($PY -c "import torch; print(torch.cuda.device_count())")
$PY -m kvcore bench hf --device "cuda:$N" >"$OUT/bad_device.txt" 2>&1
rc=$?; tail -1 "$OUT/bad_device.txt"
if [ $rc = 2 ] && ! grep -q Traceback "$OUT/bad_device.txt"; then verdict 0 x; else verdict $rc "$OUT/bad_device.txt"; fi

step "3. kvcore bench zero, defaults (JSON in bench_zero.json, tables in bench_zero.txt)"
timeout 240 $PY -m kvcore bench zero --json-out "$OUT/bench_zero.json" >"$OUT/bench_zero.txt" 2>&1
rc=$?; cat "$OUT/bench_zero.txt" | tail -40
if [ $rc = 0 ]; then
  $PY - "$OUT/bench_zero.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("memset:", r["memset"], "| empty launch us:", round(r["empty_launch_us"] or 0, 2), "| rows:", len(r["rows"]))
bad = [k for row in r["rows"] for k in ("zeroer_us", "zeroer_host_us", "memset_us", "loop_us", "zero_us")
       if not row.get(k)]
sys.exit(1 if r["memset"] is None or bad or len(r["rows"]) != 15 else 0)
EOF
  rc=$?; [ "$(wide "$OUT/bench_zero.txt")" = 0 ] || rc=1
fi
verdict $rc "$OUT/bench_zero.txt"

step "4. small kvcore bench hf on CUDA (Triton backend, CUDA graphs, prefix caching, float32 check)"
timeout 300 $PY -m kvcore bench hf --hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2 \
  --vocab 1024 --requests 8 --prompt-len 32 --new-tokens 8 --shared-prefix 64 --skip generate_batch,static \
  --check-requests 4 --check-prompt-len 16 --check-new-tokens 4 --json-out "$OUT/bench_hf.json" \
  >"$OUT/bench_hf.txt" 2>"$OUT/bench_hf.err"
rc=$?; head -3 "$OUT/bench_hf.txt"; tail -4 "$OUT/bench_hf.txt"; tail -3 "$OUT/bench_hf.err"
echo "lines over 80 columns: $(wide "$OUT/bench_hf.txt")"
[ "$(wide "$OUT/bench_hf.txt")" = 0 ] || rc=1
grep -q "kvcore, no CUDA graphs" "$OUT/bench_hf.txt" || { echo "no eager row"; rc=1; }
verdict $rc "$OUT/bench_hf.txt"

step "5. kvcore bench elastic --measure on CUDA"
timeout 120 $PY -m kvcore bench elastic --max-blocks 256 --measure --device cuda --gib 1 --repeat 5 \
  >"$OUT/bench_elastic.txt" 2>&1
rc=$?; tail -9 "$OUT/bench_elastic.txt"; verdict $rc "$OUT/bench_elastic.txt"

echo; [ $status = 0 ] && echo "gpu_cli: ALL PASS" || echo "gpu_cli: SOME FAILED (logs in $OUT)"
exit $status
