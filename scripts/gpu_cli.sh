#!/usr/bin/env bash
# Issue #22, helper 'cli': what only a CUDA machine can check (about 4 minutes on one H200).
#   1. tests/test_distributed.py::test_tp_decode_example_matches_single_process: two ranks on a
#      one-GPU machine fall back to CPU + gloo (was: "invalid device ordinal").
#   2. tests/test_hf_tp.py under the machine's transformers (5.17 read LOCAL_RANK; the spawned
#      ranks now set it and hide the GPU).
#   3. The command-line tests that change with CUDA present (--device types, bench hf).
#   4. kvcore bench hf --device cuda:N past the last GPU: usage error, exit 2, no traceback.
#   5. A small kvcore bench hf run on CUDA (Triton backend): the preflight passes, the table
#      fits 80 columns, parameters read in K/M/B.
# Run from the repository root: bash scripts/gpu_cli.sh   (logs under ${OUT:-/tmp/kvcore-gpu-cli})
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= COLUMNS=80
OUT=${OUT:-/tmp/kvcore-gpu-cli}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }

$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, \
'|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"

step "1. tp_decode example, 2 ranks (one GPU: expect CPU/gloo fallback)"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py -k tp_decode >"$OUT/tp_decode.txt" 2>&1
rc=$?; tail -4 "$OUT/tp_decode.txt"; verdict $rc "$OUT/tp_decode.txt"

step "2. tests/test_hf_tp.py (two gloo ranks serving a TP-sharded HF model)"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_hf_tp.py >"$OUT/hf_tp.txt" 2>&1
rc=$?; tail -4 "$OUT/hf_tp.txt"; verdict $rc "$OUT/hf_tp.txt"

step "3. command-line tests with CUDA present"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cli.py tests/test_bench_hf_cli.py \
  tests/test_prefix_caching_bench.py >"$OUT/cli_tests.txt" 2>&1
rc=$?; tail -4 "$OUT/cli_tests.txt"; verdict $rc "$OUT/cli_tests.txt"

step "4. bench hf --device cuda:<one past the last GPU> is a usage error"
N=$($PY -c "import torch; print(torch.cuda.device_count())")
$PY -m kvcore bench hf --device "cuda:$N" >"$OUT/bad_device.txt" 2>&1
rc=$?; tail -1 "$OUT/bad_device.txt"
if [ $rc = 2 ] && ! grep -q Traceback "$OUT/bad_device.txt"; then verdict 0 x; else verdict $rc "$OUT/bad_device.txt"; fi

step "5. small kvcore bench hf on CUDA (Triton backend, CUDA graphs)"
timeout 240 $PY -m kvcore bench hf --hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2 \
  --vocab 1024 --requests 8 --prompt-len 32 --new-tokens 8 --shared-prefix 64 --skip generate_batch,static \
  --check-requests 4 --check-prompt-len 16 --check-new-tokens 4 --json-out "$OUT/bench_hf.json" \
  >"$OUT/bench_hf.txt" 2>"$OUT/bench_hf.err"
rc=$?; head -3 "$OUT/bench_hf.txt"; tail -3 "$OUT/bench_hf.txt"; tail -3 "$OUT/bench_hf.err"
wide=$($PY -c "import sys; print(sum(len(l.rstrip(chr(10))) > 80 for l in open(sys.argv[1], encoding='utf-8')))" \
  "$OUT/bench_hf.txt")
echo "lines over 80 columns: $wide"
[ "$wide" = 0 ] || rc=1
verdict $rc "$OUT/bench_hf.txt"

echo; [ $status = 0 ] && echo "gpu_cli: ALL PASS" || echo "gpu_cli: SOME FAILED (logs in $OUT)"
exit $status
