# Sourced by the GPU scripts that use NIXL: installs NIXL from the wheels in .whl/ into
# /tmp/nixl-site when it does not import, and puts libcudart of torch's CUDA major (which UCX's
# CUDA module needs) on LD_LIBRARY_PATH. Expects $PY; prepends /tmp/nixl-site to PYTHONPATH.
if ! $PY -c "import nixl._api" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nixl-site \
    .whl/nixl-*.whl .whl/nixl_cu*.whl >/dev/null 2>&1 || echo "NIXL wheels did not install from .whl/"
  export PYTHONPATH=/tmp/nixl-site${PYTHONPATH:+:$PYTHONPATH}
fi
CUDART_DIR=$($PY -c "import glob, os, torch; d = os.path.dirname(os.path.dirname(torch.__file__)); \
c = sorted(glob.glob(d + '/nvidia/**/libcudart.so.' + torch.version.cuda.split('.')[0], recursive=True)); \
print(os.path.dirname(c[0]) if c else '')")
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH=$CUDART_DIR:${LD_LIBRARY_PATH:-}
