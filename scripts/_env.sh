# Sourced by the GPU scripts that run `kvcore bench` or import kvcore_bench. The benchmarks are
# their own distribution (benchmarks/) whose command kvcore finds through an entry point (group
# kvcore.cli), so PYTHONPATH alone is not enough: install it (editable, no dependencies, no
# network). Expects $PY; prepends benchmarks/ to PYTHONPATH.
if ! $PY -m pip install -q --no-deps --no-build-isolation -e benchmarks >/tmp/kvcore-bench-pip.txt 2>&1; then
  echo "pip install -e benchmarks failed (below); declaring its entry point in /tmp/kvcore-bench-ep"
  tail -3 /tmp/kvcore-bench-pip.txt
  # NOTE: a bare dist-info on sys.path is all importlib.metadata needs to find the entry point.
  EP=/tmp/kvcore-bench-ep/kvcore_bench-0.1.0.dist-info; mkdir -p $EP
  printf 'Metadata-Version: 2.1\nName: kvcore-bench\nVersion: 0.1.0\n' >$EP/METADATA
  printf '[kvcore.cli]\nbench = kvcore_bench.cli:add_command\n' >$EP/entry_points.txt
  export PYTHONPATH=/tmp/kvcore-bench-ep${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
