# Benchmark of MFF against the authors' svds approach (the user guide, "Speed of MFF"): a benchmark, not a test.
# The outputs are one grouped target whose prerequisites are the runner, the code it times and
# the core, so `make bench` reruns only when one of them changed (a second run does nothing).
BENCH_DIR  ?= figures/bench
BENCH_ARGS ?=
BENCH_SRC  := scripts/bench_mff.py $(addprefix fisherkron/experiments/,benchmark.py authors.py synthetic_gradients.py) fisherkron/repro/figures.py \
              $(wildcard fisherkron/hf/calibration/*.py) $(addprefix fisherkron/hf/,data.py registry.py)
BENCH_OUT  := $(foreach s,bench_mff bench_minilm_layers,$(BENCH_DIR)/$s.csv $(BENCH_DIR)/$s.md $(BENCH_DIR)/$s.tex \
                $(BENCH_DIR)/$s.provenance.json) \
              $(BENCH_DIR)/fig_bench_mff.png $(BENCH_DIR)/fig_bench_mff.pdf $(BENCH_DIR)/fig_bench_mff.provenance.json

.PHONY: bench bench-quick bench-replot
# A failed or interrupted benchmark deletes none of the last run's tables (see the notebook macro in notebooks.mk)
.PRECIOUS: $(BENCH_OUT)
bench: $(BENCH_OUT) ## benchmark MFF vs the authors' svds approach: synthetic sizes, a MiniLM layer, whole MiniLM (about 7 min on 2 idle cores)
$(BENCH_OUT) &: $(BENCH_SRC) $(CORE_SRC) | $(STAMP)
	$(PY) scripts/bench_mff.py --out $(BENCH_DIR) $(BENCH_ARGS)

bench-replot: $(STAMP) ## redraw figures/bench/fig_bench_mff.{png,pdf} from the tables already there (no timing)
	$(PY) scripts/bench_mff.py --replot --out $(BENCH_DIR)

bench-quick: $(STAMP) ## the benchmark on tiny sizes into build/bench-quick/ (seconds; checks that it runs)
	$(PY) scripts/bench_mff.py --quick --out build/bench-quick

# The recommended recipe against the old default (scripts/bench_recipe.py): a benchmark, not a test. Each case is one
# `fisherkron compress` command on SmolLM2 with a fresh cache; finished cases are kept in build/bench-recipe/cases/,
# so an interrupted run resumes (RECIPE_ARGS=--force measures them all again). The unbounded GFWSVD cases need about
# 17 GB of free disk under build/bench-recipe/scratch/ while they run.
RECIPE_ARGS ?=
RECIPE_SRC  := scripts/bench_recipe.py $(wildcard fisherkron/cli/*.py) $(HF_SRC) $(LC_SRC)
RECIPE_OUT  := $(foreach e,csv md tex provenance.json,$(BENCH_DIR)/bench_recipe.$e)

.PHONY: bench-recipe bench-recipe-quick
.PRECIOUS: $(RECIPE_OUT)
bench-recipe: $(RECIPE_OUT) ## the recommended recipe vs the old default (GFWSVD, uniform) on SmolLM2 at ratios 0.1, 0.2: perplexity, time, peak calibration disk (about 3 h on 2 idle cores; resumable)
$(RECIPE_OUT) &: $(RECIPE_SRC) $(CORE_SRC) | $(STAMP)
	$(PY) scripts/bench_recipe.py --out $(BENCH_DIR) $(RECIPE_ARGS)

bench-recipe-quick: $(STAMP) ## the recipe benchmark on a tiny random Llama into build/bench-recipe-quick/ (about 2 min; checks that it runs)
	$(PY) scripts/bench_recipe.py --quick --out build/bench-recipe-quick

# lm-eval's tasks loaded once per process against on every call (scripts/bench_lm_eval_tasks.py): a benchmark, not a test.
LMEVAL_OUT := $(foreach e,csv md tex provenance.json,$(BENCH_DIR)/bench_lm_eval_tasks.$e)

.PHONY: bench-lm-eval
.PRECIOUS: $(LMEVAL_OUT)
bench-lm-eval: $(LMEVAL_OUT) ## seconds per lm-eval call on SmolLM2 (MMLU 5-shot, zero-shot suite), tasks loaded once vs on every call (about 15 min on 2 idle cores)
$(LMEVAL_OUT) &: scripts/bench_lm_eval_tasks.py fisherkron/hf/evaluate.py fisherkron/hf/lm_eval_tasks.py | $(STAMP)
	$(PY) scripts/bench_lm_eval_tasks.py --out $(BENCH_DIR)

# lm-eval's environment report left out of each call (scripts/bench_lm_eval_report.py): a benchmark, not a test.
LMREPORT_OUT := $(foreach e,csv md tex provenance.json,$(BENCH_DIR)/bench_lm_eval_report.$e)

.PHONY: bench-lm-eval-report
.PRECIOUS: $(LMREPORT_OUT)
bench-lm-eval-report: $(LMREPORT_OUT) ## seconds per lm-eval call on SmolLM2 with and without lm-eval's environment report (1 min)
$(LMREPORT_OUT) &: scripts/bench_lm_eval_report.py fisherkron/hf/evaluate.py | $(STAMP)
	$(PY) scripts/bench_lm_eval_report.py --out $(BENCH_DIR)

# Fixed costs of every notebook and many tests (scripts/bench_overheads.py): the code hashes of cache keys parsed on
# every call against once per process, the training documents' check against the evaluation texts, and the GEMM peak
# measurement at sizes 4096 and 2048. A benchmark, not a test.
OVERHEADS_OUT := $(foreach s,bench_code_hashes bench_disjoint bench_gemm_peak,\
                   $(foreach e,csv md tex provenance.json,$(BENCH_DIR)/$s.$e))

.PHONY: bench-overheads
.PRECIOUS: $(OVERHEADS_OUT)
bench-overheads: $(OVERHEADS_OUT) ## cache-key code hashes (parsed every call vs once), disjointness check, GEMM peak (1 min)
$(OVERHEADS_OUT) &: scripts/bench_overheads.py fisherkron/env.py fisherkron/experiments/benchmark.py \
                    fisherkron/hf/recovery.py | $(STAMP)
	$(PY) scripts/bench_overheads.py --out $(BENCH_DIR)

# Weighted SVDs read back from disk by the next notebook against computed (scripts/bench_decompositions.py).
DECOMP_OUT := $(foreach e,csv md tex provenance.json,$(BENCH_DIR)/bench_decompositions.$e)

.PHONY: bench-decompositions
.PRECIOUS: $(DECOMP_OUT)
bench-decompositions: $(DECOMP_OUT) ## every SmolLM2 layer's weighted SVD computed vs read from disk (GFWSVD, SVD-LLM, FWSVD; about 5 min on 2 idle cores once the calibration is cached)
$(DECOMP_OUT) &: scripts/bench_decompositions.py fisherkron/hf/decompositions.py $(CORE_SRC) | $(STAMP)
	$(PY) scripts/bench_decompositions.py --out $(BENCH_DIR)

# Where a sensitivity-sweep evaluation's seconds go, against the GEMM rate (scripts/bench_sweep.py): a benchmark, not a test.
SWEEP_OUT := $(foreach s,bench_sweep bench_sweep_ops,$(foreach e,csv md tex provenance.json,$(BENCH_DIR)/$s.$e))

.PHONY: bench-sweep
.PRECIOUS: $(SWEEP_OUT)
bench-sweep: $(SWEEP_OUT) ## one sweep evaluation of SmolLM2 per block: seconds, FLOPs, share of the GEMM rate, CPU time by operator (about 2 min on 2 idle cores)
$(SWEEP_OUT) &: scripts/bench_sweep.py fisherkron/hf/sensitivity.py $(CORE_SRC) | $(STAMP)
	$(PY) scripts/bench_sweep.py --out $(BENCH_DIR)
