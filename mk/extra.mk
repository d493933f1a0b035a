# The extra-compression study (paper Sec. 6.4, Tab. extra-compression-results): SVD, SVD-LLM and GFWSVD as
# the start of Dobi-SVD's learned truncation and of LoRA recovery, on the decoder study's protocol (its
# calibration entry; the (a) rows it already scored are read from its cache). Scores and trained models
# are cached in data/cache/studies/extra_compression/; the cost from empty caches is estimated at the end of
# notebooks/params/tab_extra_compression_results.default.yaml.
# This file calls the `notebook` macro of mk/notebooks.mk, which the Makefile reads before the other mk files.
EXTRA_SRC := $(HF_SRC) $(HF_TRAIN_SRC) $(LC_SRC) $(EXP)/llm_summary.py $(EXP)/extra_compression.py \
             $(EXP)/extra_summary.py

$(eval $(call notebook,tab_extra_compression_results,$(call tab,tab_extra_compression_results) $(call fig,fig_extra_compression_training) $(FIGDIR)/tab_extra_compression_results_summary.provenance.json,$(EXTRA_SRC)))
tab_extra_compression_results: ## Tab. extra-compression-results (Sec. 6.4): SVD / SVD-LLM / GFWSVD at allocated ranks, + Dobi-SVD's learned truncation, + LoRA, 20 / 40 % (10 % if 40 % collapses), 3 seeds, on SmolLM2 (about 5.8 h cold)
