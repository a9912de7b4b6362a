#!/usr/bin/env bash
# GPU check of the block zeroer (issue #4). Run from the repository root on a CUDA machine:
#   bash scripts/gpu_check_zeroer.sh            # uses .venv/bin/python, else python
#   PY=python bash scripts/gpu_check_zeroer.sh
# Writes the benchmark JSON to ${OUT:-.}/zeroer_bench.json and prints the table.
set -euo pipefail
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
export TRITON_INTERPRET=  # the compiled kernel, not the interpreter
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
"$PY" -m pytest tests/test_zeroer_gpu.py tests/test_zeroer.py tests/test_bench_zero.py -q -rs
"$PY" -m kvcore bench zero --json-out "${OUT:-.}/zeroer_bench.json"
