#!/usr/bin/env bash
# One GPU session: install, GPU tests, decode sweep, zeroer variants, demo on CUDA, TP on 2 GPUs.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . -e plugins/kvcore-torch -e plugins/kvcore-triton >"$OUT/pip.txt" 2>&1 || tail -5 "$OUT/pip.txt"
python -c "import kvcore, kvcore_triton, torch; print('kvcore ok', torch.__version__, torch.cuda.device_count())"
echo "== GPU tests"; timeout 200 python -m pytest plugins tests/test_zeroer_gpu.py tests/test_runtime.py tests/test_engine_loop.py tests/test_distributed.py -q -p no:cacheprovider -x 2>&1 | tail -6
echo "== demo on CUDA"
for a in "" "--block-size 128" "--hybrid --layout BLNHC" "--no-check --num-seqs 256 --max-num-seqs 32 --num-blocks 2000 --token-budget 512"; do
  echo "-- run_decode.py $a"; timeout 90 python examples/run_decode.py $a 2>&1 | tail -4
done
echo "== TP on 2 GPUs"; timeout 120 torchrun --standalone --nproc-per-node 2 examples/tp_decode.py 2>&1 | tail -5
echo "== zeroer variants"
for cfg in "4 512" "8 512" "8 1024" "4 1024" "16 1024" "2 256"; do
  set -- $cfg
  timeout 60 python -c "import sys,kvcore.zeroer.kernel as k; k.NUM_WARPS=$1; k.ROWS=$2; from kvcore.cli import main; main(['bench','zero','--blocks','1,512,4096','--layouts','LBNHC,LHBNC','--repeats','20','--json-out','$OUT/zw_$1_$2.json'])" >/dev/null 2>&1
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['layout'][:3], r['blocks'], round(r['bw_vs_memset'],3), round(r['zeroer_us'],1)) for r in d['rows']])" "$OUT/zw_$1_$2.json" "warps=$1 rows=$2"
done
echo "== decode sweep"; timeout 240 python plugins/kvcore-triton/bench_decode.py --sweep --json >"$OUT/decode_sweep.json" 2>"$OUT/decode_err.txt"; echo "rc=$?"; tail -25 "$OUT/decode_err.txt"
python -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d)[:2500])" "$OUT/decode_sweep.json"
