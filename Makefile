# qsa_lab: `make demo` and `make test` work on a fresh machine with no other step.
# Environment: inside an active conda env, that env; otherwise a .venv made here with pip.
# torch is installed only when none is importable (a V100 node's CUDA 12 torch must stay);
# on the build machines `torch==2.13.0` resolves to a CPU build kept on local disk.
SHELL := /bin/bash
ifdef CONDA_PREFIX
ENV_DIR := $(CONDA_PREFIX)
PY := python
else
ENV_DIR := .venv
PY := .venv/bin/python
endif
STAMP := $(ENV_DIR)/.qsa_lab-setup
TORCH_FALLBACK ?= torch==2.13.0

.PHONY: setup demo test test-fast lab doctor clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ -z "$$CONDA_PREFIX" ] && [ ! -x .venv/bin/python ]; then echo "creating .venv"; python3 -m venv .venv; fi
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "using the torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else echo "no torch importable: installing $(TORCH_FALLBACK)"; $(PY) -m pip install -q "$(TORCH_FALLBACK)"; fi
	$(PY) -m pip install -q -e ".[lab,test]"
	@touch $@

# demo regenerates results/ and figures/ (--force: it replaces its own earlier outputs)
demo: setup
	$(PY) -m qsa_lab doctor
	$(PY) -m qsa_lab repro --out results --figures figures --force

test: setup
	bash scripts/setup_test_extras.sh "$(PY)"
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e"

lab: setup
	$(PY) -m jupyter lab notebooks/

doctor: setup
	$(PY) -m qsa_lab doctor

clean:
	rm -rf build results figures .pytest_cache
