#!/usr/bin/env bash
# Issue #23 item 4, helper 'hf': kvcore/hf builds every step with ONE builder (kvcore/hf/step.py,
# StepBuilder.build(batch, pad_to=...)); CUDA graphs (DecodeGraphs in kvcore/hf/step.py) now only capture and
# replay the padded steps it stages. What only a CUDA machine checks (about 4 minutes on one H200,
# every step capped; logs under ${OUT:-/tmp/kvcore-gpu-hf}):
#   1. tests/test_cuda_graph_decode.py (a whole decode step in one CUDA graph, Triton backend).
#   2. The hf tests on CUDA with the interpreter off: token equality with model.generate through
#      captured decode graphs (triton and torch backends), every graph captured when the engine is
#      built and none lazily, graphs across an elastic grow, faults, the flashinfer fake's host plans.
#   3. `kvcore bench hf` kvcore row: graph steps still replay (stats graph_steps > 0) and its tok/s
#      is comparable with BENCHMARKS.md's kvcore row of the same shape (no regression expected).
# Run from the repository root: bash scripts/gpu_hf.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/kvcore-gpu-hf}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer${PYTHONPATH:+:$PYTHONPATH}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }

$PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"

step "1. tests/test_cuda_graph_decode.py"
timeout -k 5 45 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graph_decode.py >"$OUT/graph_decode.txt" 2>&1
rc=$?; tail -2 "$OUT/graph_decode.txt"; verdict $rc "$OUT/graph_decode.txt"

step "2. hf tests on CUDA (interpreter off)"
timeout -k 5 125 $PY -m pytest -q -rs -p no:cacheprovider tests/test_hf_engine.py tests/test_hf_defaults.py \
  tests/test_hf_faults.py tests/test_hf_elastic.py tests/test_elastic_gpu.py \
  plugins/kvcore-flashinfer/tests/test_flashinfer_fake.py >"$OUT/hf_tests.txt" 2>&1
rc=$?; grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/hf_tests.txt" | head -12; tail -2 "$OUT/hf_tests.txt"
verdict $rc "$OUT/hf_tests.txt"

step "3. kvcore bench hf: kvcore row only (8 layers, 64 requests; graph_steps must be > 0)"
timeout -k 5 65 $PY -m kvcore bench hf --backend auto --layers 8 --requests 64 \
  --skip eager,generate_batch,static,check,profile,prefix --json-out "$OUT/bench_hf.json" >"$OUT/bench_hf.txt" 2>&1
rc=$?; grep -v -E "Warning|warn\(" "$OUT/bench_hf.txt" | tail -12
if [ $rc = 0 ]; then
  $PY - "$OUT/bench_hf.json" <<'PY' || rc=1
import json, sys
data = json.load(open(sys.argv[1]))
found = []
def walk(node, path=""):
    if isinstance(node, dict):
        if "graph_steps" in node:
            found.append((path, node["graph_steps"]))
        for key, value in node.items():
            walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            walk(value, f"{path}[{i}]")
walk(data)
print("graph_steps:", found)
sys.exit(0 if found and all(n > 0 for _, n in found) else 1)
PY
fi
verdict $rc "$OUT/bench_hf.txt"

echo; [ $status = 0 ] && echo "gpu_hf: ALL PASS" || echo "gpu_hf: SOME STEP FAILED (logs in $OUT)"
exit $status
