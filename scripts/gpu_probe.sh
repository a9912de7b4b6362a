#!/usr/bin/env bash
# One GPU call for issue #23's zeroer host time (before/after, same run) and issue #26's NIXL probe.
# Needs .old/ (kvcore of 6b1f375, `git archive 6b1f375 kvcore | tar -x -C .old`) and NIXL wheels in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-probe}; mkdir -p "$OUT"
PY=${PY:-python3}
NEW=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton
echo "== zeroer host us, before (6b1f375) / after (HEAD), alternating"
for i in 1 2; do
  PYTHONPATH=$PWD/.old timeout 60 $PY scripts/gpu_zeroer_probe.py --label before 2>&1 | tail -1 | tee -a "$OUT/zeroer.jsonl"
  PYTHONPATH=$NEW timeout 60 $PY scripts/gpu_zeroer_probe.py --label after --parts 2>&1 | tail -1 | tee -a "$OUT/zeroer.jsonl"
done
export PYTHONPATH=$NEW
source scripts/_nixl_env.sh
source scripts/_bench_env.sh  # kvcore bench: install benchmarks/ (its entry point)
probe() { local tag=$1; shift; echo "== nixl probe $tag"; timeout 150 $PY scripts/gpu_nixl_probe.py --json "$OUT/probe_$tag.json" "$@" 2>&1 | grep -v "NIXL INFO" | tail -8; }
probe default
probe threads4 --threads 4 --layouts BLNHC
probe vram_dram --memory VRAM-DRAM --layouts BLNHC --counts 16,256
UCX_CUDA_IPC_MAX_STREAMS=32 probe streams32 --layouts BLNHC --counts 256
echo "== done"
