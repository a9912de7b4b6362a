#!/usr/bin/env bash
# memspecs shrink (issue 23), GPU check of what changed in kvcore/memory + kvcore/specs (repo root;
# about 2 minutes). Only GPU-only code changed: memory/backing_cuda.py (one _call helper, the
# reservation is what torch wraps) and the CUDA branch of memory/backing.py reserve_backing.
#   bash scripts/gpu_memspecs.sh       logs under ${OUT:-/tmp/kvcore-gpu}
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:tests:plugins/kvcore-torch:plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
$PY -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
echo "== 1. CudaBacking smoke: reserve, commit reads zero, decommit, recommit, errors"
timeout 60 $PY - <<'PY' 2>&1 | tee "$OUT/memspecs_backing.txt"
import torch
from kvcore.errors import KVCoreError
from kvcore.memory.backing import reserve_backing
b = reserve_backing(5 * 2**21 + 123, torch.device("cuda"))
g = b.granularity
print("granule", g, "size", b.size, "tensor", b.tensor.numel(), b.tensor.device)
assert b.tensor.numel() == 5 * 2**21 + 123 and b.size % g == 0
assert not b.tensor[:g].any(), "granule 0 must read zero"
b.commit(0, 3 * g); b.tensor[: 3 * g].fill_(7); torch.cuda.synchronize()
b.decommit(g, 2 * g); b.commit(g, 2 * g)
assert not b.tensor[g : 2 * g].any() and (b.tensor[: g] == 7).all(), "recommitted granule reads zero"
try:
    b.commit(1, g)
except ValueError as exc:
    print("misaligned refused:", exc)
try:
    reserve_backing(2**21, torch.device("cuda"), granularity=2**21)
except ValueError as exc:
    print("granularity refused:", exc)
print("CUDA BACKING OK")
PY
echo "== 2. GPU and elastic tests"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_elastic_gpu.py tests/test_elastic.py \
  tests/test_allocate.py tests/test_zeroer_gpu.py 2>&1 | tee "$OUT/memspecs_tests.txt" | tail -8
echo "== summary"; grep -h "CUDA BACKING OK\|passed\|failed\|Error" "$OUT"/memspecs_*.txt | tail -5
