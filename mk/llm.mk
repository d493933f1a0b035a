# The decoder study (paper Sec. 6.3 and its appendices): Tabs. Llama31_compression_50 /
# Llama2_chat_compression_50 (tab_llm_compression_main), Tabs. Llama2_compression / Llama3_compression and
# Fig. mmlu_avg (tab_llm_compression_mmlu), Tab. ablation_diag_results and the transposition pitfall
# (tab_ablation_diag). The three notebooks share one calibration entry, the sensitivity sweeps and every
# scored case (data/cache/studies/llm_compression/), so the second and third reuse what the first computed.
# Their cost from empty caches is estimated in notebooks/params/<name>.default.yaml.
# This file calls the `notebook` macro of mk/notebooks.mk, which the Makefile reads before the other mk files.
LLM_SRC := $(HF_SRC) $(LC_SRC) $(EXP)/llm_summary.py

$(eval $(call notebook,tab_llm_compression_main,$(call tab,tab_llm_compression_main) $(call fig,fig_llm_compression) $(FIGDIR)/tab_llm_compression_main_summary.provenance.json,$(LLM_SRC)))
tab_llm_compression_main: ## Tabs. Llama31_compression_50 / Llama2_chat_compression_50 + Fig. llm_compression (Sec. 6.3): 5 methods x 2 blocks at 20-50 %, perplexities and six zero-shot tasks, on SmolLM2

$(eval $(call notebook,tab_llm_compression_mmlu,$(call tab,tab_llm_compression_mmlu) $(call fig,fig_mmlu_avg) $(FIGDIR)/tab_llm_compression_mmlu_summary.provenance.json,$(LLM_SRC)))
tab_llm_compression_mmlu: ## Tabs. Llama2_compression / Llama3_compression + Fig. mmlu_avg (App. MMLU): 5-20 %, perplexities and 5-shot MMLU, on SmolLM2

$(eval $(call notebook,tab_ablation_diag,$(call tab,tab_ablation_diag tab_gfwsvd_transposed) $(FIGDIR)/tab_ablation_diag_summary.provenance.json,$(LLM_SRC)))
tab_ablation_diag: ## Tab. ablation_diag_results (App.): FWSVD / Diag / Non-diag / Full GFWSVD at the same ranks, and the untransposed-L_B pitfall, on SmolLM2

# The rank allocations' quality against their cost, on the decoder study's calibration and sweeps.
$(eval $(call notebook,fig_allocation_cost,$(call tab,tab_allocation_cost) $(call fig,fig_allocation_cost fig_allocation_prediction) $(FIGDIR)/fig_allocation_cost_summary.provenance.json,$(LLM_SRC) $(EXP)/allocation_cost.py))
fig_allocation_cost: ## Fig. + Tab. allocation_cost (beyond the paper): uniform / fisher / sensitivity / lems / calibrated allocations, quality against evaluations spent, on SmolLM2

# The scale study: SmolLM2, Gemma 3 270M and Qwen2.5-0.5B with one protocol; GFWSVD's gap to its rivals against
# size, and GFWSVD with shrunk factors. Its own calibrations (k = 16) and cases, cached and resumable.
$(eval $(call notebook,fig_scale,$(call tab,tab_scale) $(call fig,fig_scale) $(FIGDIR)/fig_scale_summary.provenance.json,$(LLM_SRC) $(EXP)/scale.py))
fig_scale: ## Fig. + Tab. scale (beyond the paper): six methods x two allocations on three decoders of growing size, GFWSVD's gap to its best rival, shrunk GFWSVD
