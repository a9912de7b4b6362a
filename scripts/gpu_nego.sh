#!/usr/bin/env bash
# Negotiation on a CUDA machine (repository root, one GPU, ~1 minute): what "auto" picks,
# kernel requirements with the Triton interpreter OFF, and an "auto" KV cache attending
# through Triton. Logs go to ${OUT:-/tmp/kvcore-gpu}/nego_*.txt.
#   bash scripts/gpu_nego.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET= PYTHONPATH=.:plugins/kvcore-torch:plugins/kvcore-triton
OUT=${OUT:-/tmp/kvcore-gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
# The first-party backends are found through their entry points: install them when absent.
if ! $PY -c "import importlib.metadata as m, sys; sys.exit({'torch', 'triton'} > {e.name for e in m.entry_points(group='kvcore.plugins')})"; then
  $PY -m pip install -q --no-deps --no-build-isolation -e plugins/kvcore-torch -e plugins/kvcore-triton >"$OUT/nego_pip.txt" 2>&1 \
    || { echo "could not install the plugins (see $OUT/nego_pip.txt)"; tail -3 "$OUT/nego_pip.txt"; }
fi
$PY -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
echo "== kvcore plugins (expect 'auto picks    cpu: torch; cuda: triton')"
timeout 60 $PY -m kvcore plugins 2>&1 | tee "$OUT/nego_plugins.txt" | grep -A2 -E 'requires|auto picks'
timeout 60 $PY -m kvcore plugins --json > "$OUT/nego_plugins.json" 2>&1
echo "== select_backend and requirements with the interpreter off"
timeout 60 $PY - <<'PY' 2>&1 | tee "$OUT/nego_select.txt"
import torch, kvcore
from kvcore.errors import KernelRequirementError
spec = kvcore.FullAttentionSpec(16, 8, 128, torch.bfloat16)
print("cuda ->", kvcore.select_backend(spec, "cuda").name, "| cpu ->", kvcore.select_backend(spec, "cpu").name)
try:
    kvcore.KVCache.create({"l0": spec}, {"l0": "triton"}, device="cpu", num_blocks=4, max_num_seqs=1, max_model_len=16)
    print("UNEXPECTED: triton accepted a CPU cache without the interpreter")
except KernelRequirementError as e:
    print("triton on cpu refused as expected:", str(e)[:160])
PY
echo "== tests (GPU test + the negotiation tests, interpreter off)"
timeout 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_kernel_requirements.py tests/test_kernel_rules.py \
  tests/test_attn_group_record.py tests/test_negotiation.py 2>&1 | tee "$OUT/nego_tests.txt" | tail -15
