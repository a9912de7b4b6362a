#!/usr/bin/env bash
# Runtime shrink (third round) on one CUDA GPU, from the repository root: the GPU tests of
# kvcore/runtime, then the zeroer's host time per zero_block_ids(list) call and its device time and
# bandwidth, for this tree ("after") and, when one is found, the tree before the shrink ("before"),
# alternating in the same run. The zeroer's kernel and launch path did not change, only where its
# staging buffer and segment table live, so "after" should match "before" within noise.
#   OUT=/tmp/out bash scripts/gpu_runtime.sh     # about 3 minutes; each step has its own timeout
# "before": $BEFORE (a checkout of b89008d or older), else `git archive b89008d` when .git is here.
# Writes $OUT/runtime_gpu_tests.txt, $OUT/host_us.jsonl, $OUT/device.jsonl; prints a summary.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
unset KVCORE_DEBUG_CHECKS
OUT=${OUT:-/tmp/kvcore-gpu-runtime}; mkdir -p "$OUT"
PY=${PY:-python3}
PLUG=plugins/kvcore-torch:plugins/kvcore-triton
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton
START=$SECONDS
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1. GPU tests of kvcore/runtime"
timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_zeroer_gpu.py tests/test_elastic_gpu.py \
    tests/test_cuda_graph_decode.py tests/test_backends_no_sync.py tests/test_runtime.py 2>&1 \
    | tee "$OUT/runtime_gpu_tests.txt" | tail -6
echo "   rc=${PIPESTATUS[0]} (0: all passed)"

BEFORE=${BEFORE:-}
if [ -z "$BEFORE" ] && git rev-parse b89008d >/dev/null 2>&1; then
    BEFORE=$OUT/before; mkdir -p "$BEFORE"
    git archive b89008d kvcore plugins/kvcore-torch plugins/kvcore-triton | tar -x -C "$BEFORE"
fi
TREES="after=$PWD"
if [ -n "$BEFORE" ] && [ -d "$BEFORE/kvcore" ]; then
    TREES="before=$BEFORE after=$PWD before=$BEFORE after=$PWD"
else
    echo "   (no 'before' tree: set BEFORE=<checkout of b89008d> to compare; timing 'after' only)"
fi

echo "== 2. host us per zero_block_ids(list) call (median of 300, device idle before each; LBNHC, 32 layers)"
: > "$OUT/host_us.jsonl"
for tree in $TREES; do
    label=${tree%%=*}; root=${tree#*=}
    PYTHONPATH=$root:$root/${PLUG/:/:$root/} timeout 90 $PY scripts/gpu_zeroer_probe.py --label "$label" \
        | tee -a "$OUT/host_us.jsonl"
done

echo "== 3. device us per call and GB/s (CUDA events, median of 50; 32 layers, 8 KV heads x 128, bf16)"
: > "$OUT/device.jsonl"
for tree in $TREES; do
    label=${tree%%=*}; root=${tree#*=}
    # NOTE: run from $OUT so that the tree under test, not the current directory, provides kvcore
    (cd "$OUT" && PYTHONPATH=$root:$root/${PLUG/:/:$root/} timeout 120 $PY - "$label") <<'EOF' | tee -a "$OUT/device.jsonl"
import json, statistics, sys
import torch
from kvcore.memory.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvcore.memory.layout import compute_layout_strides
from kvcore.memory.views import allocate_kv_cache
from kvcore.runtime.zeroer import KVBlockZeroer
from kvcore.specs import FullAttentionSpec

LAYERS, POOL = 32, 8192
spec, names = FullAttentionSpec(16, 8, 128, torch.bfloat16), [f"layers.{i}.attn" for i in range(LAYERS)]
import kvcore
row = {"label": sys.argv[1], "kvcore": kvcore.__file__}
for layout in ("LBNHC", "BLNHC"):
    s = compute_layout_strides(spec, POOL, LAYERS, layout)
    tensor = KVCacheTensor(POOL * LAYERS * spec.page_size_bytes, names, s[0], s[1])
    kv = allocate_kv_cache(KVCacheConfig(POOL, [tensor], [KVCacheGroupSpec(names, spec)], layout), "cuda")
    zeroer = KVBlockZeroer.from_views("cuda", {n: (kv[n], 1) for n in names}, POOL)
    zeroer.warmup(0)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 64, 512, 4096):
        ids = torch.randperm(POOL, generator=gen)[:n].tolist()
        for _ in range(5):
            zeroer.zero_block_ids(ids)
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            zeroer.zero_block_ids(ids)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        us = statistics.median(times)
        row[f"{layout}_{n}_us"] = round(us, 2)
        row[f"{layout}_{n}_GBps"] = round(n * LAYERS * spec.page_size_bytes / us / 1e3, 1)
    del kv, zeroer
    torch.cuda.empty_cache()
print(json.dumps(row), flush=True)
EOF
done

echo "== summary (compare 'after' with 'before' row by row; host us within ~10%, GB/s within ~3%)"
cat "$OUT/host_us.jsonl" "$OUT/device.jsonl"
echo "done in $((SECONDS - START)) s; results under $OUT"
