#!/usr/bin/env bash
# KV transfer on one CUDA GPU (issue 26), most important first, all within ~7.5 minutes:
#   1. NIXL from the trimmed wheels in .whl/ (nixl-1.5.1 selector + nixl_cu13 made by
#      scripts/trim_nixl_wheel.py), versions, GPU topology
#   2. the GPU transfer tests (NIXL on VRAM, two processes on one GPU, host tier streams)
#   3. NIXL VRAM->VRAM between two processes on one GPU vs a d2d copy_ of the same bytes, and
#      VRAM<->host (VRAM-DRAM) vs pinned memcpy: 2 MiB blocks, BLNHC and LBNHC, 64 and 256 blocks
#   4. the host tier (HostKVPool offload / restore) in all six layouts vs pinned memcpy, and the
#      NIXL descriptor count / build time per layout for 32 layers x 1,000 blocks
#   5. the disaggregated example with both engines on CUDA (two processes on one GPU)
#   6. UCX's own diagnostics (UCX_LOG_LEVEL, UCX_PROTO_INFO) for UCX_TLS variants, one process vs
#      two, with and without NIXL's progress thread: which transport carried the bytes, and why
#   7. the example again with Gemma 3 (two KV cache groups) in LHBNC
# Every step has its own timeout and the script stops starting steps after DEADLINE seconds.
# Everything goes to $OUT (default /tmp/kvcore-gpu-transfer); SUMMARY.txt is the short version.
#   bash scripts/gpu_transfer.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu-transfer}; mkdir -p "$OUT"
PY=${PY:-python3}
DEADLINE=${DEADLINE:-450}
export PYTHONPATH=${PYTHONPATH:-.:plugins/kvcore-torch:plugins/kvcore-triton}
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
SUMMARY=$OUT/SUMMARY.txt; : >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME TIMEOUT CMD...: run CMD with at most TIMEOUT seconds (less if the deadline is near),
# its output in $OUT/NAME.log; prints the exit status and the time it took.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then say "== $name: SKIPPED (deadline: ${SECONDS}s used)"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "== $name: exit $rc in $((SECONDS - start))s (limit ${limit}s)$([ $rc = 124 ] && echo ' TIMED OUT')"
  return $rc
}

# --- 1. NIXL from .whl/ -------------------------------------------------------------------------
if ! $PY -c "import nixl._api" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nixl-site \
    .whl/nixl-*.whl .whl/nixl_cu*.whl >"$OUT/pip.log" 2>&1 || say "NIXL wheels did not install (see pip.log)"
  export PYTHONPATH=/tmp/nixl-site:$PYTHONPATH
fi
# The plugins' entry points (the examples pick backends by name or "auto").
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton >>"$OUT/pip.log" 2>&1 \
  || say "plugin installs failed (see pip.log)"
# UCX's CUDA module needs libcudart of torch's CUDA major; torch's wheels keep it under nvidia/.
CUDART_DIR=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
c = sorted(glob.glob(d + '/nvidia/**/libcudart.so.' + torch.version.cuda.split('.')[0], recursive=True)); print(os.path.dirname(c[0]) if c else '')")
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR:${LD_LIBRARY_PATH:-}
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import platform, torch
try:
    import nixl
    where = nixl._pkg.__name__
except Exception as exc:  # reported, the steps below then skip their NIXL rows
    where = f"NOT importable: {exc!r}"
print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda, "|",
      torch.cuda.get_device_name(), "x", torch.cuda.device_count(), "| NIXL:", where)
EOF
(nvidia-smi -L; nvidia-smi topo -m; nvidia-smi -q -d COMPUTE) >"$OUT/gpu_topology.txt" 2>&1
grep -i "compute mode" "$OUT/gpu_topology.txt" | head -1 | tee -a "$SUMMARY"

BENCH="$PY -m kvcore bench transfer"
show() {  # the tables of a bench JSON, within 80 columns
  $PY - "$1" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
from kvcore_bench import transfer
try:
    result = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"(no results: {exc})")
if isinstance(result, list):  # rows of scripts/gpu_nixl_rows.py
    from kvcore_bench.transfer_nixl import print_rows
    print_rows(result, 80)
else:
    transfer._print(result)
EOF
}

# --- 2. GPU tests ---------------------------------------------------------------------------------
step tests 110 $PY -m pytest -q -rs -p no:cacheprovider tests/test_nixl_gpu.py tests/test_host_pool.py \
  benchmarks/tests/test_transfer_bench.py tests/test_descriptor_checks.py tests/test_transfer_transport.py
tail -4 "$OUT/tests.log" | tee -a "$SUMMARY"

# --- 3. NIXL VRAM<->VRAM (two processes, one GPU) and VRAM<->host, 2 MiB blocks --------------------
# (scripts/gpu_nixl_rows.py: the bench's rows, its JSON rewritten after each layout, so a timeout keeps them)
step nixl_vram 150 $PY scripts/gpu_nixl_rows.py --nixl-memory VRAM,VRAM-DRAM --nixl-peer process \
  --layouts BLNHC,LBNHC --nixl-blocks 64,256 --repeats 3 --warmup 1 --json-out "$OUT/nixl_vram.json"
show "$OUT/nixl_vram.json"

# --- 4. host tier, six layouts --------------------------------------------------------------------
step host_tier 100 $BENCH --no-nixl --blocks 16,256 --repeats 5 --warmup 2 --json-out "$OUT/host_tier.json"
show "$OUT/host_tier.json"

# NIXL descriptor counts and build time, 32 layers x 1,000 blocks (CPU work; this host is idle)
step descriptors 40 $BENCH --descriptors 1000 --layers 32 --kv-heads 8 --json-out "$OUT/descriptors.json"
tail -16 "$OUT/descriptors.log" | tee -a "$SUMMARY"

# --- 5. the disaggregated example on CUDA ---------------------------------------------------------
step example_llama 100 $PY examples/disaggregated.py --device cuda --arch llama --layout BLNHC --prompts 3
grep -E "transfer of|tokens equal|MISMATCH|decode engine|failed" "$OUT/example_llama.log" | tee -a "$SUMMARY"
# --- 6. UCX diagnostics ---------------------------------------------------------------------------
DIAG="--no-host --nixl-memory VRAM --layouts BLNHC --nixl-blocks 32 --repeats 2 --warmup 1"
diag() {  # diag NAME PEER "ENV..." [extra bench options]
  local name=$1 peer=$2 vars=$3; shift 3
  step "ucx_$name" 40 env UCX_LOG_LEVEL=${LOG:-info} UCX_PROTO_INFO=y NIXL_LOG_LEVEL=INFO $vars \
    $BENCH $DIAG --nixl-peer "$peer" --json-out "$OUT/ucx_$name.json" "$@"
  $PY - "$OUT/ucx_$name.json" "$name" "$vars" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(f"   {sys.argv[2]}: no result ({sys.argv[3] or 'default UCX_TLS'})")
for row in r["nixl"]:
    print(f"   {sys.argv[2]:<16} write {row['nixl_write_gbps']:8.2f} GB/s  read {row['nixl_read_gbps']:8.2f} GB/s  "
          f"d2d copy_ {row['copy_gbps']:7.0f}  exact {row['exact']}  kvcore says {row['transport']}  [{sys.argv[3] or 'default'}]")
for memory, error in r["nixl_failed"].items():
    print(f"   {sys.argv[2]}: {memory} failed: {error[:200]}")
EOF
  # UCX's own words: the lanes and protocols it chose, and CUDA context or reachability complaints.
  $PY scripts/gpu_nixl_ucx_evidence.py "$OUT/ucx_$name.log" >"$OUT/ucx_${name}_evidence.txt" 2>&1
}
diag two_proc process ""
diag one_proc local ""
diag ipc_copy_tcp process "UCX_TLS=cuda_ipc,cuda_copy,tcp"
diag tcp_copy process "UCX_TLS=tcp,cuda_copy"
diag ipc_getzcopy process "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"
diag no_prog_thread process "" --nixl-no-progress-thread
LOG=debug diag two_proc_debug process ""
find "$OUT" -name "ucx_*.log" -size +20M -exec gzip -f {} \;  # debug logs are large; the evidence files stay
for f in "$OUT"/ucx_*_evidence.txt; do  # the data lanes UCX chose, and what it complained about
  echo "--- $(basename "$f")" >>"$SUMMARY"
  grep -E "lanes: .*intra-node|remote memory (write|read)|WARN|ERROR|context|reach|nvlink" "$f" | grep -v "host memory to host" \
    | sed -E 's/^ +//' | cut -c1-230 | head -14 >>"$SUMMARY"
done

# --- 7. the example with two KV cache groups and a layer-compact layout, if time is left
step example_gemma3 80 $PY examples/disaggregated.py --device cuda --arch gemma3 --layout LHBNC --prompts 4
grep -E "transfer of|tokens equal|MISMATCH|decode engine|failed" "$OUT/example_gemma3.log" | tee -a "$SUMMARY"

say "== done in ${SECONDS}s; logs, JSON and UCX evidence in $OUT"
