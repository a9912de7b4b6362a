#!/usr/bin/env bash
# Second GPU call of this session: NixlAgent's prepared-list path on CUDA (GPU tests, the bench's
# VRAM rows in all six layouts), UCX's protocol table for VRAM -> host memory of another process,
# and `kvcore bench zero` of 6b1f375 (.old/) and HEAD side by side.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-probe2}; mkdir -p "$OUT"
PY=${PY:-python3}
NEW=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
echo "== bench zero, before (6b1f375) and after (HEAD)"
for label in before after; do
  P=$NEW; [ $label = before ] && P=$PWD/.old
  PYTHONPATH=$P timeout 100 $PY -m kvcore bench zero --json-out "$OUT/zero_$label.json" > "$OUT/zero_$label.txt" 2>&1
  echo "   $label rc=$?"; tail -25 "$OUT/zero_$label.txt"
done
export PYTHONPATH=$NEW
source scripts/_nixl_env.sh
$PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton >/dev/null 2>&1
echo "== NIXL GPU tests"
timeout 150 $PY -m pytest -q -rs -p no:cacheprovider tests/test_nixl_gpu.py tests/test_nixl.py benchmarks/tests/test_transfer_bench.py 2>&1 | grep -v "NIXL INFO" | tail -6
echo "== bench transfer NIXL VRAM rows, two processes, all layouts"
timeout 200 $PY scripts/gpu_nixl_rows.py --nixl-memory VRAM --layouts LBHNC,LBNHC,LHBNC,BLHNC,BLNHC,BHLNC \
  --nixl-blocks 16,64,256 --repeats 5 --warmup 1 --json-out "$OUT/rows_vram.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/rows_vram.txt" | grep -E "^\s*VRAM|failed|s with setup"
echo "== UCX protocol for VRAM -> DRAM of another process"
UCX_LOG_LEVEL=info UCX_PROTO_INFO=y timeout 60 $PY scripts/gpu_nixl_rows.py --nixl-memory VRAM-DRAM --layouts BLNHC \
  --nixl-blocks 16 --repeats 2 --warmup 1 > "$OUT/ucx_vram_dram.log" 2>&1
$PY scripts/gpu_nixl_ucx_evidence.py "$OUT/ucx_vram_dram.log" | grep -iE "cuda|host|WARN|lanes" | head -30
grep -E "^\s*VRAM-DRAM" "$OUT/ucx_vram_dram.log" | head
cd "$OUT" && tar czf probe2.tgz *.txt *.json *.log 2>/dev/null; ls
