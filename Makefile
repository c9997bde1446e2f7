# qsa_lab: `make demo` and `make test` work on a fresh machine with no other step.
# Environment: inside an active conda env, that env; otherwise a .venv made here with pip.
# torch is installed only when none is importable (a V100 node's CUDA 12 torch must stay);
# then `torch==2.13.0` is installed (override with TORCH_FALLBACK=...).
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

.PHONY: setup demo test test-fast lab strip doctor clean

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

# lab: the project's notebooks are saved without outputs (scripts/jupyter_lab_config.py);
# as root (many GPU nodes) Jupyter needs --allow-root
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
# LAB_ARGS: more options for Jupyter, e.g. make lab LAB_ARGS="--port 8899 --ip 0.0.0.0 --no-browser"
LAB_ARGS ?=
lab: setup
	$(PY) -m jupyter lab --config=scripts/jupyter_lab_config.py $(LAB_ROOT) $(LAB_ARGS) notebooks/

# strip: remove outputs from the project's notebooks and restore their metadata (what `make lab`
# does on every save); notebooks of your own are left alone
strip:
	python3 scripts/strip_outputs.py

doctor: setup
	$(PY) -m qsa_lab doctor

clean:
	rm -rf build results figures .pytest_cache
