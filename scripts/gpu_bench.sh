#!/usr/bin/env bash
# Issue #23 (third shrink), helper 'bench': the benchmarks now live in their own distribution
# (benchmarks/, kvcore-bench), which adds `kvcore bench` through the entry-point group kvcore.cli;
# scripts/_bench_env.sh installs it (pip install --no-deps -e benchmarks). Checks its CUDA paths.
# About 5 minutes on one H200. Each step prints PASS or FAIL; the last line sums up.
#   0. kvcore bench is found through the entry point (help lists the six benchmarks, no torch).
#   1. The benchmark tests with CUDA present (the NIXL VRAM test runs where NIXL imports).
#   2. kvcore bench zero, defaults: memset found, every row timed, tables within 80 columns.
#   3. kvcore bench transfer, small: host rows (offload / restore vs pinned memcpy) and NIXL rows
#      in VRAM, VRAM-DRAM and DRAM (skipped, not failed, without NIXL); within 80 columns.
#   4. kvcore bench hf, small: every part (eager and graphed kvcore, generate_batch, static
#      generate, prefix caching, float32 check; exit 0 only when the check's tokens match).
#   5. kvcore bench elastic --measure on CUDA.
# Run from the repository root: bash scripts/gpu_bench.sh   (logs under ${OUT:-/tmp/kvcore-gpu-bench})
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= COLUMNS=80
OUT=${OUT:-/tmp/kvcore-gpu-bench}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }
wide() { $PY -c "import sys; print(sum(len(l.rstrip(chr(10))) > 80 for l in open(sys.argv[1])))" "$1"; }

$PY -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name())"

step "0. kvcore bench through the kvcore.cli entry point"
$PY -m kvcore bench --help >"$OUT/bench_help.txt" 2>&1
rc=$?; grep -A8 "BENCHMARK" "$OUT/bench_help.txt" | head -9
for b in zero plan transfer hf pool elastic; do grep -q "^    $b " "$OUT/bench_help.txt" || rc=1; done
verdict $rc "$OUT/bench_help.txt"

if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: the benchmarks only
step "1. benchmark tests with CUDA present"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider benchmarks/tests tests/test_cli.py >"$OUT/tests.txt" 2>&1
rc=$?; tail -4 "$OUT/tests.txt"; verdict $rc "$OUT/tests.txt"
fi

step "2. kvcore bench zero, defaults (bench_zero.json / bench_zero.txt)"
timeout 240 $PY -m kvcore bench zero --json-out "$OUT/bench_zero.json" >"$OUT/bench_zero.txt" 2>&1
rc=$?; tail -40 "$OUT/bench_zero.txt"
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

step "3. kvcore bench transfer, small (host rows, NIXL VRAM / VRAM-DRAM / DRAM)"
timeout 240 $PY -m kvcore bench transfer --layouts BLNHC,LBNHC --blocks 16,64 --nixl-blocks 16 \
  --repeats 3 --warmup 1 --json-out "$OUT/bench_transfer.json" >"$OUT/bench_transfer.txt" 2>&1
rc=$?; tail -30 "$OUT/bench_transfer.txt"
[ "$(wide "$OUT/bench_transfer.txt")" = 0 ] || rc=1
grep -q "x memcpy" "$OUT/bench_transfer.txt" || rc=1
verdict $rc "$OUT/bench_transfer.txt"

step "4. small kvcore bench hf on CUDA, every part"
timeout 300 $PY -m kvcore bench hf --hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2 \
  --vocab 1024 --requests 8 --prompt-len 32 --new-tokens 8 --shared-prefix 64 \
  --check-requests 4 --check-prompt-len 16 --check-new-tokens 4 --json-out "$OUT/bench_hf.json" \
  >"$OUT/bench_hf.txt" 2>"$OUT/bench_hf.err"
rc=$?; cat "$OUT/bench_hf.txt"; tail -3 "$OUT/bench_hf.err"
[ "$(wide "$OUT/bench_hf.txt")" = 0 ] || rc=1
for row in "kvcore, no CUDA graphs" "model.generate_batch" "static model.generate" "shared prefix"; do
  grep -q "$row" "$OUT/bench_hf.txt" || { echo "missing: $row"; rc=1; }
done
verdict $rc "$OUT/bench_hf.txt"

step "5. kvcore bench elastic --measure on CUDA"
timeout 120 $PY -m kvcore bench elastic --max-blocks 256 --measure --device cuda --gib 1 --repeat 5 \
  >"$OUT/bench_elastic.txt" 2>&1
rc=$?; tail -9 "$OUT/bench_elastic.txt"; verdict $rc "$OUT/bench_elastic.txt"

echo; [ $status = 0 ] && echo "gpu_bench: ALL PASS" || echo "gpu_bench: SOME FAILED (logs in $OUT)"
exit $status
