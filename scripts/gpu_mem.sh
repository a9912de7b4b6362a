#!/usr/bin/env bash
# kvcore.memory on one CUDA GPU after the shrink round (repository root; about 1-2 minutes).
#   bash scripts/gpu_mem.sh            logs under ${OUT:-/tmp/kvcore-gpu}
# 1. tests/test_elastic_gpu.py: the CUDA VMM backing (backing_cuda.py, whose only change is where
#    it imports round_up from) grows and shrinks in place, replays a CUDA graph across a grow.
# 2. Plan + allocate every layout on cuda:0 (a hybrid full/sliding/Mamba model and a split
#    kernel block), checking each view's address and stride against the plan's tensors.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:tests:plugins/kvcore-torch:plugins/kvcore-triton${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
$PY -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)"
echo "== 1. GPU tests (tests/test_elastic_gpu.py)"
timeout 150 $PY -m pytest -q -rs -p no:cacheprovider tests/test_elastic_gpu.py 2>&1 \
  | tee "$OUT/mem_elastic_gpu.txt" | tail -8
echo "== 2. plan + allocate on cuda:0, every layout"
timeout 120 $PY - <<'PY' 2>&1 | tee "$OUT/mem_allocate.txt"
import torch
from kvcore import FullAttentionSpec, KVCacheLayout, MambaSpec, SlidingWindowSpec, MemorySnapshot
from kvcore import allocate_kv_cache, plan_kv_cache

specs = {"a.0": FullAttentionSpec(16, 4, 64, torch.bfloat16),
         "s.1": SlidingWindowSpec(16, 4, 64, torch.bfloat16, sliding_window=64),
         "m.2": MambaSpec(16, [(8, 16), (32,)], [torch.float32, torch.bfloat16])}
print("snapshot", MemorySnapshot.measure("cuda:0"))
bad = 0
for layout in KVCacheLayout:
    for name, model in (("hybrid", specs), ("dense", {"a.0": specs["a.0"], "a.1": specs["a.0"]})):
        try:
            config = plan_kv_cache(model, layout, num_blocks=64)
        except ValueError as exc:
            print(f"{layout.name:6} {name:7} refused: {str(exc)[:90]}")
            continue
        kernel = [8] if name == "dense" and layout.value[:2] == "LB" else None
        views = allocate_kv_cache(config, "cuda:0", kernel_block_sizes=kernel)
        base = next(iter(views.values())).untyped_storage().data_ptr()
        for tensor in config.kv_cache_tensors:
            for i, layer in enumerate(tensor.layers):
                v = views[layer]
                want = base + tensor.offset + i * tensor.layer_stride
                ok = v.data_ptr() == want and v.is_cuda and float(v.float().abs().sum()) == 0
                bad += not ok
        v.fill_(1)
        torch.cuda.synchronize()
        print(f"{layout.name:6} {name:7} ok: {len(views)} views, kernel split {kernel}")
print("ALL OK" if bad == 0 else f"{bad} VIEW(S) WRONG")
PY
