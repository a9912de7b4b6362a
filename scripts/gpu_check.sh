#!/usr/bin/env bash
# The GPU check of a checkout (run from the repository root on a CUDA machine). It runs named parts;
# each part prints PASS or FAIL, and its logs go under $OUT (default /tmp/kvcore-gpu-check/PART).
#   bash scripts/gpu_check.sh                every part, in the order below
#   bash scripts/gpu_check.sh suite bench    only those parts
# Parts:
#   suite       the whole test suite (tests, plugins, benchmarks) with CUDA and the interpreter off
#   bench       every `kvcore bench` through its entry point: zero (memset found, every row timed),
#               transfer (host and NIXL rows), hf (every part, tokens checked), elastic --measure;
#               tables within 80 columns
#   decode      kvcore-triton decode at 64 x 4,096 tokens (GQA 32/8, head 128, bf16) against SDPA
#               (plugins/kvcore-triton/bench_decode.py), and the whole decode step in one CUDA graph
#   transfer    the transfer GPU tests; NIXL VRAM->VRAM between two processes and VRAM<->host vs
#               copies; the host tier in every layout; staged host-tier copies equal direct ones;
#               the disaggregated example (Llama in BLNHC, Gemma 3 in LHBNC)
#   elastic     CUDA virtual memory: the elastic GPU tests, the backing's commit/release, bench
#               elastic --measure, decode over an elastic cache vs a plain one, examples/elastic.py
#   hybrid      the mixer kernel, Mamba2 prefill and hybrid GPU tests; float32 tokens equal
#               model.generate for every served hybrid (triton and torch); `kvcore bench hf --model
#               hybrid` (HYBRID_ARGS replaces its options: --requests 128 --shared-prefix 1024)
#   flashinfer  kvcore-flashinfer: what "auto" picks, decode through kvcore's views vs its own
#               tensor, engine tokens vs the torch backend, bench hf per backend, its GPU tests
#   zeroer      host microseconds of zero_block_ids for 1 to 64 ids (median and best of many calls),
#               this tree and BEFORE=<another checkout> alternately when given; its GPU tests
#   quant       the quantized cache in one run: decode per 8-bit mode against bf16 (bench_decode.py;
#               QUANT_ARGS replaces its options), `kvcore bench hf --kv-cache-dtype` per mode of
#               QUANT_MODES (tokens/s, requests whose tokens equal the bf16 cache's), fp8 at 4,096-token prompts
# FlashInfer and NIXL come from the wheels in .whl/ when they do not import (scripts/_env.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= HF_HUB_OFFLINE=1 COLUMNS=80
unset KVCORE_DEBUG_CHECKS
ROOT=${OUT:-/tmp/kvcore-gpu-check}
PY=${PY:-python3}
source scripts/_env.sh
T="$PY -m pytest -q -rs -p no:cacheprovider"
FAILED=()

run() {  # run NAME TIMEOUT CMD...: CMD's output in $LOG_DIR/NAME.txt, its tail shown; a failure fails the part
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$LOG_DIR/$name.txt" 2>&1
  local rc=$?
  grep -v -E "Warning|warn\(|NIXL INFO|falling back" "$LOG_DIR/$name.txt" | tail -n "${TAIL:-8}"
  echo "   $name: rc=$rc in $((SECONDS - t0))s$([ $rc = 124 ] && echo ' (timed out)')"
  [ $rc = 0 ] || PART_RC=1
}

narrow() {  # narrow FILE: fail the part when a table line is wider than 80 columns
  [ "$(awk 'length > 80' "$1" | wc -l)" = 0 ] || { echo "   $1: lines wider than 80 columns"; PART_RC=1; }
}

part_suite() {
  TAIL=25 run suite 1800 $T tests plugins benchmarks
}

part_bench() {
  run help 60 $PY -m kvcore bench --help
  for b in zero plan transfer hf pool elastic; do
    grep -q "^    $b " "$LOG_DIR/help.txt" || { echo "   kvcore bench --help lists no '$b'"; PART_RC=1; }
  done
  TAIL=20 run zero 240 $PY -m kvcore bench zero --json-out "$LOG_DIR/zero.json"
  run zero_rows 30 $PY - "$LOG_DIR/zero.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
bad = [k for row in r["rows"] for k in ("zeroer_us", "zeroer_host_us", "memset_us", "loop_us", "zero_us") if not row.get(k)]
print("memset:", r["memset"], "| rows:", len(r["rows"]), "| untimed:", bad)
sys.exit(1 if r["memset"] is None or bad or len(r["rows"]) != 15 else 0)
EOF
  narrow "$LOG_DIR/zero.txt"
  TAIL=20 run transfer 240 $PY -m kvcore bench transfer --layouts BLNHC,LBNHC --blocks 16,64 --nixl-blocks 16 \
    --repeats 3 --warmup 1 --json-out "$LOG_DIR/transfer.json"
  grep -q "x memcpy" "$LOG_DIR/transfer.txt" || PART_RC=1
  narrow "$LOG_DIR/transfer.txt"
  TAIL=20 run hf 300 $PY -m kvcore bench hf --hidden 256 --intermediate 512 --layers 2 --heads 4 --kv-heads 2 \
    --vocab 1024 --requests 8 --prompt-len 32 --new-tokens 8 --shared-prefix 64 --check-requests 4 \
    --check-prompt-len 16 --check-new-tokens 4 --json-out "$LOG_DIR/hf.json"
  for row in "kvcore, no CUDA graphs" "model.generate_batch" "static model.generate" "shared prefix"; do
    grep -q "$row" "$LOG_DIR/hf.txt" || { echo "   bench hf: no '$row' row"; PART_RC=1; }
  done
  run elastic 120 $PY -m kvcore bench elastic --max-blocks 256 --measure --device cuda --gib 1 --repeat 5
}

part_decode() {
  TAIL=20 run bench_decode 300 $PY plugins/kvcore-triton/bench_decode.py --layouts LBNHC,BLNHC --block-size 16,64 \
    --skip-torch-check --json
  run graph_tests 200 $T tests/test_cuda_graph_decode.py tests/test_backends_no_sync.py plugins/kvcore-triton/tests
}

part_transfer() {
  run tests 200 $T tests/test_nixl_gpu.py tests/test_host_pool.py tests/test_descriptor_checks.py \
    tests/test_transfer_transport.py benchmarks/tests/test_transfer_bench.py
  TAIL=16 run nixl_rows 200 $PY scripts/_nixl_rows.py --nixl-memory VRAM,VRAM-DRAM --nixl-peer process \
    --layouts BLNHC,LBNHC --nixl-blocks 64,256 --repeats 3 --warmup 1 --json-out "$LOG_DIR/nixl_rows.json"
  TAIL=24 run host_tier 120 $PY -m kvcore bench transfer --no-nixl --blocks 16,256 --repeats 5 --warmup 2
  TAIL=16 run descriptors 60 $PY -m kvcore bench transfer --descriptors 1000 --layers 32 --kv-heads 8
  run staged_equals_direct 60 $PY - <<'EOF'
import torch
from _transfer_caches import make_cache, raw_buffer
from kvcore.transfer import HostKVPool, host_pool

ok = True
for layout in ("BLNHC", "LBNHC", "LHBNC", "BHLNC"):
    kv = make_cache("uniform", layout, num_blocks=200, device="cuda")
    raw = raw_buffer(kv)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, device="cuda"))
    staged, direct = HostKVPool(kv, 150), HostKVPool(kv, 150, staging=False)
    src, slots, dst = ((torch.randperm(199)[:120] + 1).tolist(), torch.randperm(150)[:120].tolist(),
                       (torch.randperm(199)[:120] + 1).tolist())
    for chunk_blocks in (1, 3, 1000):
        host_pool.CHUNK_BYTES = chunk_blocks * staged.block_bytes
        staged.host.zero_()
        direct.host.zero_()
        staged.offload(src, slots)
        direct.offload(src, slots)
        same_host = torch.equal(staged.host, direct.host) and staged.host.count_nonzero() > 0
        before = raw.clone()
        staged.restore(slots, dst)
        torch.cuda.synchronize()
        after = raw.clone()
        raw.copy_(before)
        direct.restore(slots, dst)
        torch.cuda.synchronize()
        same_device = torch.equal(raw, after) and not torch.equal(after, before)
        ok &= same_host and same_device
        print(f"{layout} chunks of {chunk_blocks} blocks: host equal {same_host}, restored equal {same_device}")
raise SystemExit(0 if ok else 1)
EOF
  for case in "llama BLNHC 3" "gemma3 LHBNC 4"; do
    set -- $case
    run "example_$1" 120 $PY examples/disaggregated.py --device cuda --arch "$1" --layout "$2" --prompts "$3"
    grep -q MISMATCH "$LOG_DIR/example_$1.txt" && PART_RC=1
  done
}

part_elastic() {
  run tests 200 $T tests/test_elastic_gpu.py tests/test_allocate.py
  run backing 60 $PY - <<'EOF'
import torch
from kvcore.memory.backing import reserve_backing

b = reserve_backing(5 * 2**21 + 123, torch.device("cuda"))
g = b.granularity
assert b.tensor.numel() == 5 * 2**21 + 123 and b.size % g == 0 and not b.tensor[:g].any()
b.commit(0, 3 * g)
b.tensor[: 3 * g].fill_(7)
torch.cuda.synchronize()
b.decommit(g, 2 * g)
b.commit(g, 2 * g)
assert not b.tensor[g : 2 * g].any() and (b.tensor[:g] == 7).all(), "a recommitted granule must read zero"
for bad in (lambda: b.commit(1, g), lambda: reserve_backing(2**21, torch.device("cuda"), granularity=2**21)):
    try:
        bad()
    except ValueError as exc:
        print("refused:", exc)
    else:
        raise AssertionError("not refused")
print("granule", g, "bytes: commit, release and recommit in place")
EOF
  TAIL=12 run bench_elastic 90 $PY -m kvcore bench elastic --measure --max-blocks 2048 --gib 1
  TAIL=10 run decode 150 $PY scripts/_elastic_decode.py --iters 20 --rounds 2 --json "$LOG_DIR/decode.json"
  TAIL=12 run example 120 $PY examples/elastic.py --device cuda --rounds 2 --requests 16 --prompt-len 1000 \
    --max-new-tokens 16
}

part_hybrid() {
  TAIL=12 run kernels 150 $T plugins/kvcore-triton/tests/test_mixer_kernels.py plugins/kvcore-triton/tests/test_mamba2_prefill.py
  TAIL=12 run gpu_tests 200 $T tests/test_hf_step_memory.py tests/test_hf_mixer_backends.py -m kvcore_gpu
  TAIL=16 run tokens 150 $PY scripts/_hybrid_tokens.py "$LOG_DIR/tokens.json"
  TAIL=45 run bench_hf 420 $PY -m kvcore bench hf --model hybrid ${HYBRID_ARGS:---requests 128 --shared-prefix 1024} \
    --json-out "$LOG_DIR/bench_hf.json"
  grep -q "Traceback" "$LOG_DIR/bench_hf.txt" && { echo "   bench hf: a traceback"; PART_RC=1; }
}

part_flashinfer() {
  run pick 120 $PY -c "
import torch, flashinfer, kvcore
print('flashinfer', flashinfer.__version__, '|', torch.cuda.get_device_name())
pick = kvcore.select_backend(kvcore.FullAttentionSpec(16, 8, 128, torch.bfloat16), 'cuda').name
print('auto on cuda ->', pick)"
  run plugins 60 $PY -m kvcore plugins
  TAIL=20 run bench_decode 200 $PY plugins/kvcore-triton/bench_decode.py --flashinfer --block-size 16,64 \
    --layouts LBNHC,LBHNC,BLNHC --skip-torch-check --iters 30 --json
  run tokens_llama 200 $PY scripts/_flashinfer_tokens.py llama --json-out "$LOG_DIR/tokens_llama.json"
  for b in auto flashinfer triton; do
    TAIL=12 run "bench_hf_$b" 120 $PY -m kvcore bench hf --backend "$b" --layers 8 --heads 16 --kv-heads 4 \
      --requests 64 --shared-prefix 0 --skip eager,generate_batch,static,prefix,check,profile
  done
  run tests 300 $T plugins/kvcore-flashinfer/tests tests/test_hf_defaults.py
}

part_zeroer() {
  run tests 120 $T tests/test_zeroer_gpu.py tests/test_zeroer.py
  : >"$LOG_DIR/host_us.jsonl"
  local trees="after=$PWD"
  [ -n "${BEFORE:-}" ] && trees="before=$BEFORE after=$PWD before=$BEFORE after=$PWD before=$BEFORE after=$PWD"
  for tree in $trees; do
    local root=${tree#*=}
    # NOTE: from $LOG_DIR, so that the tree under test (first on PYTHONPATH) provides kvcore
    (cd "$LOG_DIR" && PYTHONPATH=$root:$root/plugins/kvcore-triton:$root/plugins/kvcore-torch \
      timeout 120 $PY "$OLDPWD/scripts/_zeroer_host.py" --label "${tree%%=*}" --calls "${CALLS:-500}") \
      | tee -a "$LOG_DIR/host_us.jsonl" || PART_RC=1
  done
}

part_quant() {
  TAIL=40 run bench_decode 240 $PY plugins/kvcore-triton/bench_decode.py --skip-torch-check --json \
    ${QUANT_ARGS:---kv-cache-dtype fp8,fp8_e5m2,int8_per_token_head,fp8_per_token_head --layouts LBNHC --block-size 64}
  local mode
  for mode in ${QUANT_MODES:-int8_per_token_head fp8_per_token_head fp8}; do
    TAIL=6 run "hf_$mode" 150 $PY -m kvcore bench hf --kv-cache-dtype "$mode" --new-tokens 32 --shared-prefix 0 \
      --skip generate_batch,static,prefix,eager,profile,check --json-out "$LOG_DIR/hf_$mode.json"
  done
  TAIL=6 run hf_long_fp8 200 $PY -m kvcore bench hf --kv-cache-dtype fp8 --prompt-len 4096 --new-tokens 128 \
    --shared-prefix 0 --skip generate_batch,static,prefix,check,eager,profile,reference \
    --json-out "$LOG_DIR/hf_long_fp8.json"
}

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(suite bench decode transfer elastic hybrid flashinfer zeroer quant)
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'x', torch.cuda.device_count(), '| torch', \
torch.__version__, '| triton', triton.__version__)"
for part in "${PARTS[@]}"; do
  if ! declare -F "part_$part" >/dev/null; then
    echo "unknown part '$part'; parts: suite bench decode transfer elastic hybrid flashinfer zeroer quant"
    exit 2
  fi
  LOG_DIR=$ROOT/$part; mkdir -p "$LOG_DIR"; PART_RC=0; START=$SECONDS
  echo "== $part"
  "part_$part"
  if [ $PART_RC = 0 ]; then echo "== $part: PASS in $((SECONDS - START))s (logs in $LOG_DIR)"
  else echo "== $part: FAIL in $((SECONDS - START))s (logs in $LOG_DIR)"; FAILED+=("$part"); fi
done
[ ${#FAILED[@]} = 0 ] && echo "gpu_check: PASS (${PARTS[*]})" || echo "gpu_check: FAIL (${FAILED[*]})"
[ ${#FAILED[@]} = 0 ]
