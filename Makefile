# `make demo` and `make test` each create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvcore-installed
PLUGINS := plugins/kvcore-torch plugins/kvcore-triton plugins/kvcore-flashinfer
# `kvcore bench`: the benchmarks are their own distribution (benchmarks/), installed with the plugins.
BENCH := benchmarks
# The Triton kernels run on CPU tensors through the interpreter when no GPU is present.
CPU_ENV := $(shell $(PYTHON) -c "import shutil,sys; sys.stdout.write('' if shutil.which('nvidia-smi') else 'TRITON_INTERPRET=1')")

.PHONY: demo test venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml $(wildcard plugins/*/pyproject.toml) $(BENCH)/pyproject.toml
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch==2.13.0 is the local CPU wheel; an existing torch>=2.4 is reused.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	# transformers==5.23.0 is known to work here; an existing transformers>=5 is reused.
	$(PY) -c "import transformers" 2>/dev/null || $(PIP) install -q transformers==5.23.0
	$(PIP) install -q -e ".[test,hf,nixl]" $(addprefix -e ,$(wildcard $(PLUGINS))) -e $(BENCH)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(CPU_ENV) $(PY) examples/serve_hf.py
	@echo
	@echo "kvcore is installed in .venv: run 'source .venv/bin/activate' once per shell, or try:"
	@echo "  .venv/bin/kvcore plan gemma-3-27b --memory 40GiB"
	@echo "  .venv/bin/python examples/run_decode.py --hybrid --layout BLNHC"
	@echo "  .venv/bin/kvcore plugins"

test: $(STAMP)
	$(VENV)/bin/ruff check kvcore plugins benchmarks tests examples
	$(CPU_ENV) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
