# Notebooks that regenerate the paper's figures and tables.
#
# Each notebook notebooks/<name>.py (jupytext py:percent) is converted to .ipynb
# and executed by papermill with the parameters of the selected profile,
#   notebooks/params/<name>.$(PROFILE).yaml      (PROFILE = default | paper | smoke)
# plus `output_dir` (where figures/tables go) and `profile`. The executed
# notebook is kept in build/notebooks/$(PROFILE)/<name>.ipynb; the figures and
# tables go to $(FIGDIR):
#   PROFILE=default -> figures/          (committed, with provenance records, and the
#                      executed notebook as notebooks/executed/<name>.ipynb, committed too)
#   PROFILE=paper   -> figures/paper/
#   PROFILE=smoke   -> build/smoke/figures/   (never touches figures/)
#
# Adding a notebook (3 lines, in this file or in your own mk/*.mk):
#   $(eval $(call notebook,tab_bert_glue,$(call tab,tab_glue_results) $(call fig,fig_bert_glue_avg),data/x.json))
#   tab_bert_glue: ## Tab. glue_results + Fig. bert_glue_avg (Sec. 6.2)
# Arguments: notebook name; the files it writes (`fig`/`tab` list the files of
# a figure/table saved with fisherkron.repro.figures.save_figure/save_table); extra
# prerequisites (data it reads). The notebook's outputs are one grouped target
# whose prerequisites are the notebook, its params file, the core sources and
# the extra prerequisites, so an edit rebuilds exactly that notebook and a
# second `make all` does nothing. `all` and `smoke` pick it up automatically.

NB_DIR    := notebooks
NB_PARAMS := $(NB_DIR)/params
NB_BUILD  := build/notebooks/$(PROFILE)
FIGDIR_default := figures
FIGDIR_paper   := figures/paper
FIGDIR_smoke   := build/smoke/figures
FIGDIR ?= $(or $(FIGDIR_$(PROFILE)),build/$(PROFILE)/figures)
# Every notebook depends on $(CORE_SRC) (see the Makefile). A notebook that uses the Hugging
# Face layer lists $(HF_SRC) among its extra prerequisites; one that uses an experiment
# module lists that module ($(EXP)/<module>.py).
NOTEBOOKS :=

# The files of a figure / a table written by fisherkron.repro.figures (with provenance records).
fig = $(foreach s,$1,$(FIGDIR)/$s.png $(FIGDIR)/$s.pdf $(FIGDIR)/$s.provenance.json)
tab = $(foreach s,$1,$(FIGDIR)/$s.csv $(FIGDIR)/$s.md $(FIGDIR)/$s.tex $(FIGDIR)/$s.provenance.json)

# The executed notebooks a reader sees without running anything (`make book` renders
# them): a run at PROFILE=default that writes FIGDIR=figures also writes the committed copy
# notebooks/executed/<name>.ipynb (python -m fisherkron.repro.book strip: timing metadata and
# random cell ids removed, written atomically). For that run the committed copy, not the one in
# build/, is the target make tracks beside the figures, so a fresh clone has nothing to run. Any
# other profile or FIGDIR (smoke, paper, a re-execution into build/ such as `make verify`) never
# writes it: run_notebook writes it only when the `notebook` macro passes its third argument.
NB_EXECUTED := $(NB_DIR)/executed
nb_commits = $(and $(filter default,$(PROFILE)),$(filter figures,$(FIGDIR)),$(filter build/notebooks/default,$(NB_BUILD)),yes)
# $(call nb_executed,NAME): the executed notebook make tracks for NAME
nb_executed = $(if $(nb_commits),$(NB_EXECUTED)/$1.ipynb,$(NB_BUILD)/$1.ipynb)

# $(call run_notebook,NAME,OUTPUTS[,COMMITTED]): execute one notebook with
# fisherkron.repro.execute (jupytext, then papermill with the profile's parameters; the one
# definition of how, which `make verify` runs too): the executed .ipynb is written under a temporary
# name and moved into place, a failed run leaves build/.../NAME.failed.ipynb. Every declared output
# must exist afterwards. The notebook's stderr (progress bars) streams into $(NB_BUILD)/NAME.progress.log.
# With COMMITTED (notebooks/executed/NAME.ipynb, see above) the stripped committed copy is written there too.
define run_notebook
	@echo "[notebook] $1 (PROFILE=$(PROFILE), outputs in $(FIGDIR)/)"
	$(PY) -m fisherkron.repro.execute $1 --profile $(PROFILE) --figdir $(FIGDIR) --build $(NB_BUILD)
	@for f in $2; do test -e "$$f" || { echo "[notebook] $1 did not write $$f" >&2; exit 1; }; done
	$(if $3,$(PY) -m fisherkron.repro.book strip $(NB_BUILD)/$1.ipynb $3)
endef

# $(eval $(call notebook,NAME,OUTPUTS,EXTRA_PREREQS))
# The outputs are .PRECIOUS: a failed or interrupted run deletes none of them. GNU make 4.3's
# .DELETE_ON_ERROR deletes every member of a grouped target but the first when the recipe fails, changed
# or not: a notebook stopped in its tenth row deleted the committed table, figure and executed notebook
# of the run before it. Nothing is lost by keeping them: every output is written atomically, and the
# executed notebook is replaced only by a run in which every cell ran, so after a failure it is older
# than what changed and the next make re-runs the notebook.
define notebook
NOTEBOOKS += $1
.PHONY: $1
.PRECIOUS: $2 $(call nb_executed,$1)
$1: $2 $(call nb_executed,$1)
$2 $(call nb_executed,$1) &: $(NB_DIR)/$1.py $(NB_PARAMS)/$1.$(PROFILE).yaml $(CORE_SRC) $3 | $(STAMP)
	$$(call run_notebook,$1,$2,$(if $(nb_commits),$(NB_EXECUTED)/$1.ipynb))
endef

$(NB_PARAMS)/%.yaml:
	@echo "missing parameter file $@: write it (keys = the notebook's parameters cell) or pick another PROFILE" >&2
	@exit 1

# -- the notebooks ---------------------------------------------------------------
$(eval $(call notebook,kronecker_fisher_from_scratch,$(call fig,kronecker_fisher_from_scratch kronecker_fisher_from_scratch_mff fig_connection2fwsvd),$(HF_SRC) $(EXP)/teaching.py $(EXP)/synthetic_gradients.py))
kronecker_fisher_from_scratch: ## teaching notebook: Kronecker-factored Fisher from scratch (Secs. 3-5, App. E) + Fig. connection2fwsvd

$(eval $(call notebook,fig_synthetic_correlations,$(call fig,fig_corr fig_diag_full_synth) $(call tab,tab_diag_full_synth tab_synthetic_gaps) $(FIGDIR)/fig_synthetic_correlations_summary.provenance.json,$(EXP)/synthetic.py))
fig_synthetic_correlations: ## Fig. corr + Fig. diag_full_synth (Sec. 6.1): synthetic covariance experiment

# The MFF runtime study (Fig./Tab. time_algo, Sec. 4.2); the authors' approach runs beside ours.
$(eval $(call notebook,fig_time_algo,$(call fig,fig_time_algo) $(call tab,tab_time_algo tab_time_algo_sweep),$(addprefix $(EXP)/,benchmark.py authors.py synthetic_gradients.py)))
fig_time_algo: ## Fig. + Tab. time_algo (Sec. 4.2): MFF runtime against layer size and k, vs the authors' approach

# Rank allocation on the embedded decoder (Sec. 6.3 protocol): uniform, ASVD sensitivity, Fisher-predicted.
$(eval $(call notebook,fig_rank_allocation,$(call fig,fig_rank_allocation fig_rank_allocation_validation) $(call tab,tab_rank_allocation) $(FIGDIR)/fig_rank_allocation_summary.provenance.json,$(HF_SRC) $(EXP)/rank_allocation.py))
fig_rank_allocation: ## Sec. 6.3: per-layer rank allocation (uniform / sensitivity / Fisher) x methods x ratios on SmolLM2 (100 min on 2 cores)

# Kronecker spectrum of every linear layer of SmolLM2 and MiniLM (Sec. 4, Fig. singular_values); about 20 min on 2 cores.
$(eval $(call notebook,fig_singular_values,$(call fig,fig_singular_values) $(call tab,tab_singular_values tab_singular_values_layers tab_singular_values_k) $(FIGDIR)/fig_singular_values_summary.provenance.json,$(HF_SRC) $(EXP)/spectrum.py))
fig_singular_values: ## Fig. singular_values (Sec. 4): top singular values of R(F) for every linear layer of SmolLM2 and MiniLM

# FLOPs and inference speed of GFWSVD-compressed SmolLM2 (App. F, Tabs. flops_comparison, throughput_fwsvd, throughput_forward).
$(eval $(call notebook,tab_throughput,$(call tab,tab_flops_comparison tab_throughput_fwsvd tab_throughput_forward tab_throughput_layers) $(call fig,fig_throughput) $(FIGDIR)/tab_throughput_summary.provenance.json,$(HF_SRC) $(EXP)/throughput.py $(EXP)/spectrum.py))
tab_throughput: ## Tabs. flops_comparison, throughput_fwsvd, throughput_forward (App. F): FLOPs and measured speed of compressed SmolLM2

# Calibration at scale on SmolLM2: cost and quality against k and granularity.
$(eval $(call notebook,fig_calibration,$(call fig,fig_calibration) $(call tab,tab_calibration tab_calibration_cost) $(FIGDIR)/fig_calibration_summary.provenance.json,$(HF_SRC) $(EXP)/calibration_study.py $(addprefix $(EXP)/,benchmark.py authors.py synthetic_gradients.py)))
fig_calibration: ## calibration at scale: GFWSVD / KFAC-SVD / SVD-LLM against k and granularity, cost against the 15-min target (about 85 min cold on 2 Intel Xeon cores, its last 25 min beside another run)

# Encoder compression (Sec. 6.2): MiniLM fine-tuned per task and seed, its FFN layers compressed by rank.
$(eval $(call notebook,tab_glue_results,$(call tab,tab_glue_results tab_glue_extended) $(call fig,fig_bert_glue_avg) $(FIGDIR)/tab_glue_results_summary.provenance.json,$(HF_SRC) $(EXP)/glue.py $(EXP)/glue_summary.py))
tab_glue_results: ## Tab. glue_results + Tab. glue_extended + Fig. bert_glue_avg (Sec. 6.2): fine-tune MiniLM per task, compress its FFN layers by rank (about 100 min cold)
# About 100 minutes on 2 cores from a cold cache (measured; the estimate is in
# notebooks/params/tab_glue_results.default.yaml), 32 s from a complete one.

# -- aggregate targets ----------------------------------------------------------
# Second expansion: `all` sees the notebooks that mk/*.mk files read after this one add.
.SECONDEXPANSION:
.PHONY: all notebooks clean-build ledger-save ledger-restore
all: notebooks ## regenerate every figure and table (PROFILE=default|paper; default writes figures/)
notebooks: $$(NOTEBOOKS) ## execute every notebook whose inputs changed (PROFILE as for `all`)

clean-build: ## remove executed notebooks and smoke outputs (build/notebooks, build/smoke)
	rm -rf build/notebooks build/smoke

# The ledger (fisherkron/repro/ledger.py): the finished scores and sweeps of a long study, committed so that it
# resumes on another machine. `all` and `verify` never read it; restore it only to resume.
ledger-save: | $(STAMP) ## copy finished study scores and sweeps from data/cache into data/ledger (to commit)
	$(PY) -m fisherkron.repro.ledger save
ledger-restore: | $(STAMP) ## copy data/ledger into data/cache where missing (resume a long study on a new machine)
	$(PY) -m fisherkron.repro.ledger restore

# A cold `make all` (fisherkron/repro/cold.py): every notebook of the default profile, by name, from empty caches in
# build/cold/data (the embedded models linked), outputs into figures/ as `make all`; a finished notebook is skipped
# by the next call, an interrupted one resumes from its caches. fig_scale keeps its own budget and is not in it.
.PHONY: cold-run cold-status cold-save
cold-run: | $(STAMP) ## every notebook from empty caches (build/cold/data), by name, resumable; hours: `make cold-status` adds up its runs
	$(PY) -m fisherkron.repro.cold run $(if $(NB),--nb $(NB))
cold-status: | $(STAMP) ## which notebooks of the cold run finished, and their wall time over all their runs (saves first, as cold-save)
	$(PY) -m fisherkron.repro.cold status
cold-save: | $(STAMP) ## the cold run's finished scores, sweeps and runs log into data/ledger/cold (to commit)
	$(PY) -m fisherkron.repro.cold save
