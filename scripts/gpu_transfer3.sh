#!/usr/bin/env bash
# Third shrink round, transfer area: the GPU paths it touched, in under 3 minutes.
#   1. HostKVPool on CUDA: the staged path (ring of device buffers on two streams) now builds its
#      chunks in place and keeps its table per group selection; tests/test_host_pool.py runs its
#      CUDA round trips, and a larger cache checks staged == run-by-run bytes for 1, 3 and many
#      chunks, offload and restore, with a host time per call for the record.
#   2. NixlAgent starts NIXL in one with-block (the cache's device current): tests/test_nixl_gpu.py
#      (skips its NIXL rows when NIXL does not import; installed from .whl/ when present).
# Run from the repo root: bash scripts/gpu_transfer3.sh. Logs in $OUT; the last lines say PASS/FAIL.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
OUT=${OUT:-/tmp/kvcore-gpu-transfer3}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton}
STATUS=0
if ! $PY -c "import nixl._api" 2>/dev/null && ls .whl/nixl-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nixl-site \
    .whl/nixl-*.whl .whl/nixl_cu*.whl >"$OUT/pip.log" 2>&1 || echo "NIXL wheels did not install"
  export PYTHONPATH=/tmp/nixl-site:$PYTHONPATH
fi
CUDART_DIR=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
c = sorted(glob.glob(d + '/nvidia/**/libcudart.so.' + torch.version.cuda.split('.')[0], recursive=True)); print(os.path.dirname(c[0]) if c else '')")
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR:${LD_LIBRARY_PATH:-}

run() {  # run NAME LIMIT CMD...: output in $OUT/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc | $(grep -E 'passed|failed|error|PASS|FAIL' "$OUT/$name.log" | tail -1)"
  [ $rc = 0 ] || STATUS=1
}

run host_pool_tests 50 $PY -m pytest -x -q -p no:cacheprovider tests/test_host_pool.py
run host_pool_staged 40 $PY - <<'EOF'
import sys, time
sys.path.insert(0, "tests")
import torch
from _transfer_caches import make_cache, raw_buffer
from kvcore.transfer import HostKVPool, host_pool

ok = True
for layout in ("BLNHC", "LBNHC", "LHBNC", "BHLNC"):
    kv = make_cache("uniform", layout, num_blocks=200, device="cuda")
    raw = raw_buffer(kv)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, device="cuda"))
    staged, direct = HostKVPool(kv, 150), HostKVPool(kv, 150, staging=False)
    src = (torch.randperm(199)[:120] + 1).tolist()
    slots = torch.randperm(150)[:120].tolist()
    dst = (torch.randperm(199)[:120] + 1).tolist()
    for chunk_blocks in (1, 3, 1000):
        host_pool.CHUNK_BYTES = chunk_blocks * staged.block_bytes
        staged.host.zero_()
        direct.host.zero_()
        t = time.perf_counter()
        staged.offload(src, slots)
        offload_ms = (time.perf_counter() - t) * 1e3
        direct.offload(src, slots)
        same_host = torch.equal(staged.host, direct.host) and staged.host.count_nonzero() > 0
        before = raw.clone()
        staged.restore(slots, dst)
        torch.cuda.synchronize()
        after = raw.clone()
        raw.copy_(before)
        direct.restore(slots, dst)
        torch.cuda.synchronize()
        same_dev = torch.equal(raw, after) and not torch.equal(after, before)
        ok &= same_host and same_dev
        print(f"{layout} chunk={chunk_blocks:4d} blocks: offload staged {offload_ms:7.2f} ms | "
              f"host equal {same_host} | restore equal {same_dev}")
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
EOF
run nixl_gpu_tests 80 $PY -m pytest -x -q -p no:cacheprovider tests/test_nixl_gpu.py
echo "transfer3 GPU check: $([ $STATUS = 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
