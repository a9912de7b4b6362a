#!/usr/bin/env bash
# Issue #23 items 3/5/7, helper 'settings': what only a CUDA machine can check (about 3 minutes on one H200).
#   1. kvcore-triton reads the interpreter off its own kernels: INTERPRETED is False on a compiled import.
#   2. The tests whose paths changed, with CUDA present and the interpreter off: CUDA-graph decode
#      (build_metadata now fills debug_checks in on the host before each step), the Triton plugin and
#      its CUDA-graph test, the no-sync backends, settings, kernel requirements, FlashInfer on GPU
#      (skips by itself when flashinfer is not installed).
#   3. On CUDA: KVCache.create reads KVCORE_DEBUG_CHECKS once; forward (triton) honours the switch
#      the cache read, whatever the environment says later: 1 -> a bad slot is refused before any
#      write; unset -> the bad slot is skipped with no device sync.
# Run from the repository root: bash scripts/gpu_settings.sh   (logs under ${OUT:-/tmp/kvcore-gpu-settings})
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=
unset KVCORE_DEBUG_CHECKS
OUT=${OUT:-/tmp/kvcore-gpu-settings}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer${PYTHONPATH:+:$PYTHONPATH}
status=0
step() { echo; echo "== $1"; }
verdict() { if [ "$1" = 0 ]; then echo "-> PASS"; else echo "-> FAIL (rc $1, log $2)"; status=1; fi; }

$PY -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"

step "1. kvcore_triton._checks.INTERPRETED on a compiled import (expect False)"
$PY -c "from kvcore_triton import _checks; print('INTERPRETED =', _checks.INTERPRETED); raise SystemExit(int(_checks.INTERPRETED))" \
  >"$OUT/interpreted.txt" 2>&1
rc=$?; tail -2 "$OUT/interpreted.txt"; verdict $rc "$OUT/interpreted.txt"

step "2. tests on the changed paths, CUDA present"
timeout 420 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda_graph_decode.py tests/test_backends_no_sync.py \
  tests/test_settings.py tests/test_kernel_requirements.py tests/test_plugins.py \
  plugins/kvcore-triton/tests/test_triton_plugin.py plugins/kvcore-triton/tests/test_cuda_graph.py \
  plugins/kvcore-triton/tests/test_cpu_without_interpreter.py plugins/kvcore-flashinfer/tests/test_flashinfer_gpu.py \
  >"$OUT/tests.txt" 2>&1
rc=$?; grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/tests.txt" | head -12; tail -2 "$OUT/tests.txt"; verdict $rc "$OUT/tests.txt"

step "3. debug_checks read at KVCache.create, honoured by the Triton forward on CUDA"
cat >"$OUT/debug_checks.py" <<'EOF'
import os
import torch
import kvcore
from kvcore.plugins.backend import CommonAttentionMetadata

BS = 16
def cache():
    spec = kvcore.FullAttentionSpec(BS, 2, 64, torch.float16)
    return kvcore.KVCache.create({"l0": spec}, {"l0": "triton"}, device="cuda", num_blocks=4,
                                 max_num_seqs=2, max_model_len=2 * BS)

def step(kv, slot):
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([5], dtype=torch.int32, device="cuda"),
        block_table_tensor=torch.tensor([[1, 2]], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.tensor([slot], device="cuda"), num_reqs=1, num_actual_tokens=1,
        max_query_len=1, max_seq_len=5)
    meta = kv.build_metadata([common])["l0"]
    q, k, v = (torch.randn(1, 2, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    view = kv.layer_kv_caches["l0"]
    view.copy_(torch.randn_like(view))
    before = view.clone()
    return meta, q, k, v, view, before

os.environ["KVCORE_DEBUG_CHECKS"] = "1"
checked = cache()
os.environ.pop("KVCORE_DEBUG_CHECKS")
plain = cache()
print("settings read:", checked.settings.debug_checks, plain.settings.debug_checks)
assert checked.settings.debug_checks is True and plain.settings.debug_checks is None
meta, q, k, v, view, before = step(checked, 4 * BS)
try:
    checked.attn_groups[0][0].backend.forward(q, k, v, view, meta, head_size=64, scale=0.125)
    raise SystemExit("FAIL: the bad slot was not refused under KVCORE_DEBUG_CHECKS=1 at create")
except ValueError as exc:
    print("refused:", str(exc)[:90])
assert torch.equal(view, before), "FAIL: the cache changed before the refusal"
os.environ["KVCORE_DEBUG_CHECKS"] = "1"  # later changes reach only the next create
meta, q, k, v, view, before = step(plain, 4 * BS)
out = plain.attn_groups[0][0].backend.forward(q, k, v, view, meta, head_size=64, scale=0.125)
torch.cuda.synchronize()
assert torch.equal(view, before) and torch.isfinite(out).all(), "FAIL: the bad slot was written"
print("plain cache: bad slot skipped, output finite")
EOF
timeout 180 $PY "$OUT/debug_checks.py" >"$OUT/debug_checks.txt" 2>&1
rc=$?; tail -4 "$OUT/debug_checks.txt"; verdict $rc "$OUT/debug_checks.txt"

echo
[ $status = 0 ] && echo "gpu_settings: ALL PASS" || echo "gpu_settings: SOME STEPS FAILED (logs in $OUT)"
exit $status
