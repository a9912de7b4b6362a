#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . -e plugins/kvcore-torch -e plugins/kvcore-triton >"$OUT/pip.txt" 2>&1 || tail -5 "$OUT/pip.txt"
echo "== decode sweep"
timeout 330 python plugins/kvcore-triton/bench_decode.py --sweep --block-size 16,64 --skip-torch-check --budget-s 240 --json >"$OUT/sweep.txt" 2>"$OUT/sweep_err.txt"; echo "rc=$?"
grep -E "BEST|copy|sdpa|SDPA" "$OUT/sweep.txt" | grep -v '^{' | head -30
echo "== zeroer variants"
for cfg in "2 256 8" "1 128 8" "2 128 16" "2 512 8" "1 256 16" "2 256 16"; do
  set -- $cfg
  timeout 50 python -c "import kvcore.zeroer.kernel as k; k.NUM_WARPS=$1; k.ROWS=$2; k.PROGRAMS_PER_SM=$3; from kvcore.cli import main; main(['bench','zero','--blocks','1,512,4096','--layouts','LBNHC,BLNHC,LHBNC','--repeats','20','--json-out','$OUT/zw.json'])" >/dev/null 2>&1
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layout'][:3], r['blocks'], round(r['bw_vs_memset'],3)) for r in d['rows']])" "$OUT/zw.json" "warps=$1 rows=$2 pps=$3"
done
