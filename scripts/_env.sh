# Sourced by scripts/gpu_check.sh (repository root, $PY set): puts this checkout first on PYTHONPATH,
# installs the benchmarks and the plugins editable (no dependencies, no network) so that their
# entry points exist, NIXL and FlashInfer from the wheels in .whl/ when they do not import (made
# by scripts/trim_nixl_wheel.py and scripts/trim_flashinfer_wheel.py), and libcudart of torch's
# CUDA major on LD_LIBRARY_PATH (UCX's CUDA module needs it).
export PYTHONPATH=$PWD:$PWD/tests:$PWD/benchmarks:$PWD/plugins/kvcore-torch:$PWD/plugins/kvcore-triton:$PWD/plugins/kvcore-flashinfer${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -m pip install -q --no-deps --no-build-isolation -e benchmarks -e plugins/kvcore-torch \
    -e plugins/kvcore-triton -e plugins/kvcore-flashinfer >/tmp/kvcore-gpu-pip.txt 2>&1; then
  echo "editable installs failed (tail below); declaring the entry points in /tmp/kvcore-gpu-ep"
  tail -3 /tmp/kvcore-gpu-pip.txt
  # NOTE: a bare dist-info on sys.path is all importlib.metadata needs to find an entry point.
  ep() { mkdir -p "/tmp/kvcore-gpu-ep/$1-0.1.0.dist-info"
         printf 'Metadata-Version: 2.1\nName: %s\nVersion: 0.1.0\n' "$1" >"/tmp/kvcore-gpu-ep/$1-0.1.0.dist-info/METADATA"
         printf '[%s]\n%s\n' "$2" "$3" >"/tmp/kvcore-gpu-ep/$1-0.1.0.dist-info/entry_points.txt"; }
  ep kvcore_bench kvcore.cli "bench = kvcore_bench.cli:add_command"
  for p in torch triton flashinfer; do ep "kvcore_$p" kvcore.plugins "$p = kvcore_$p.plugin"; done
  export PYTHONPATH=/tmp/kvcore-gpu-ep:$PYTHONPATH
fi
shopt -s nullglob
if ! $PY -c "import nixl._api" 2>/dev/null; then
  WHEELS=(.whl/nixl-*.whl .whl/nixl_cu*.whl)
  [ ${#WHEELS[@]} -gt 0 ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/nixl-site "${WHEELS[@]}" >/dev/null 2>&1 || echo "NIXL: not installed (no wheels in .whl/)"
  export PYTHONPATH=/tmp/nixl-site:$PYTHONPATH
fi
if ! $PY -c "import flashinfer" 2>/dev/null; then
  WHEELS=(.whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl .whl/cuda_tile-*.whl .whl/ninja-*.whl)
  [ ${#WHEELS[@]} -gt 0 ] && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "${WHEELS[@]}" >/dev/null 2>&1 || echo "FlashInfer: not installed (no wheels in .whl/)"
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  # NOTE: FlashInfer's JIT runs `ninja` from PATH: the carried wheel's when the machine has none.
  command -v ninja >/dev/null || export PATH=/tmp/site/bin:$PATH
fi
shopt -u nullglob
CUDART_DIR=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
c = sorted(glob.glob(d + '/nvidia/**/libcudart.so.' + (torch.version.cuda or '0').split('.')[0], recursive=True)); \
print(os.path.dirname(c[0]) if c else '')" 2>/dev/null)
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR:${LD_LIBRARY_PATH:-}
