# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Compressing a decoder at 5-20 % with 5-shot MMLU (paper App. "Extended decoder evaluation": Tabs. Llama2_compression, Llama3_compression, Fig. mmlu_avg)
#
# **Claim (paper App. MMLU).** "For Llama 2 7B GFWSVD consistently outperforms both simple and strong
# baselines across all compression rates"; "as the compression ratio decreases, the relative importance
# of diagonal Fisher information grows, and GFWSVD increasingly outperforms both FWSVD and ASVD"
# (Sec. 6.3). The tables report WikiText-2 and PTB perplexity and the 5-shot MMLU average and its four
# categories (± standard error) at 5 / 10 / 15 / 20 %.

# %% [markdown]
# ## Experiment
#
# **Embedded default.** SmolLM2-135M (4-bit-quantised weights, dequantised) with the
# protocol of `tab_llm_compression_main` (the same calibration, sweeps and selection, shared through
# their caches): FWSVD, ASVD, SVD-LLM and GFWSVD as the paper ran them, each method with its best
# allocation here (chosen on held-out C4 batches, never on the evaluation data), KFAC-SVD (not in the
# paper). MMLU: lm-eval's 57 subjects, 5-shot with their `dev` examples, `mmlu_limit` test questions per
# subject; a category is the pooled sample of its subjects' answers.
#
# **How to read.** Tab. `tab_llm_compression_mmlu`: per ratio and block, perplexities (lower is better)
# and MMLU accuracies ± standard error (higher is better), best per block in bold, the dense model and the
# chance level (0.25) first. Fig. `fig_mmlu_avg`: MMLU average against the achieved ratio with two
# standard errors, the dense model and chance as reference lines. SmolLM2-135M answers MMLU near chance
# even uncompressed; the verdicts say where MMLU cannot tell a method from chance.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make tab_llm_compression_mmlu`); the paper-scale value in the comment
# (`PROFILE=paper`). CPU cost of the default: see notebooks/params/tab_llm_compression_mmlu.default.yaml.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-2-7b-chat-hf" (and "meta-llama/Llama-3.1-8B-Instruct")
calib_docs = 500  # paper: 30000
k = 32  # paper: 75
batch_size = 2  # paper: 128
seq_len = 256  # paper: 2048
seed = 0
sweep_docs = 40  # paper: 600
heldout_k = 2  # paper: 1 (of 128 x 2,048)
select_k = 4  # paper: 1
layers = None  # paper: None
eval_tokens = 4096  # paper: 0 (all)
eval_seq_len = 512  # paper: 2048
sens_ratios = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]  # paper: same
mff_tol = 0.0001  # paper: 0.0001
mmlu_limit = 10  # test questions per MMLU subject (None: all); paper: None
# compressed rows scored on MMLU: "all", or "auto": only if the dense model lies more than two standard errors
# above chance; paper: "auto"
mmlu_rows = "auto"
mmlu_tasks = ["mmlu"]  # the 57-subject group (a smoke run names a few mmlu_<subject>); paper: same
lm_eval_batch_size = 8  # paper: 8
ratios = [0.05, 0.1, 0.15, 0.2]  # paper: same
methods = ["fwsvd", "asvd", "svd_llm", "gfwsvd"]  # the paper's rows (Tab. Llama2_compression); paper: same
extra_methods = ["kfac_svd"]  # not in the paper; paper: same
chance = 0.25  # four choices
collapse_multiple = 10.0

# %% tags=["hide-input"]
import time

import matplotlib.pyplot as plt
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.repro import figures
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
NB = "notebooks/tab_llm_compression_mmlu.py"
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "calib_docs", "k", "batch_size", "seq_len", "seed", "sweep_docs",
                    "heldout_k", "select_k", "layers", "eval_tokens", "eval_seq_len", "sens_ratios", "mff_tol",
                    "mmlu_limit", "mmlu_rows", "mmlu_tasks", "lm_eval_batch_size", "ratios", "methods", "extra_methods", "chance",
                    "collapse_multiple")}
proto = lc.Protocol.from_params(params)
study = lc.prepare(proto, target="tab_llm_compression_mmlu")
dense = ls.flatten(study.scores(lc.Case("dense", "dense", 0.0), ("heldout", "ppl", "mmlu")))
limit_txt = "every question" if mmlu_limit is None else f"the first {mmlu_limit} test questions of each subject"
dense_at_chance = ls.chance_level(dense["mmlu_average"], dense["mmlu_average_se"], chance)
above_chance = dense["mmlu_average"] - chance > 2 * dense["mmlu_average_se"]
score_rows = mmlu_rows == "all" or (mmlu_rows == "auto" and above_chance)
kinds = ("heldout", "ppl", "mmlu") if score_rows else ("heldout", "ppl")
print(f"dense: Wikipedia {dense['ppl_wiki']:.2f}, PTB {dense['ppl_ptb']:.2f}, MMLU {dense['mmlu_average']:.3f} ± "
      f"{dense['mmlu_average_se']:.3f} ({int(dense['mmlu_average_n'])} questions: {limit_txt}); the compressed rows "
      + ("are scored on MMLU" if score_rows else "are not scored on MMLU: the dense model itself lies no more than "
         "two standard errors above chance, so no compressed model, at most as good, could be told from chance"))

# %% [markdown]
# ## The grid
# As in `tab_llm_compression_main`: method by method, each allocation's held-out selection loss, then the
# scores of the cases shown; the 20 % cases and every sweep are shared with it through the caches.

# %%
rows, selections = lc.run_table(study, methods, ratios, kinds, extra=extra_methods)
df = pd.DataFrame(rows)
sel = ls.selection_table(selections)
display(sel)

# %%
table = ls.mmlu_table(df, ratios, dense, chance=chance)
caption = (f"{model_name} (4-bit-quantised weights, dequantised) compressed at "
           f"{', '.join(f'{100 * t:g}' for t in ratios)} %: perplexity of the first "
           f"{eval_tokens:,} tokens of a Wikipedia text (WikiText-2's role) and of PTB test, 5-shot MMLU accuracy "
           f"(lm-eval acc, {limit_txt}; categories pool their subjects' answers) ± standard error"
           + ("" if score_rows else ", for the dense model only: it lies no more than two standard errors above "
              "chance, so the compressed rows were not scored")
           + f". Chance is {chance:.2f}. Best per block in bold. Compression ratio 1 - compressed/original (over the linear layers "
           f"in parentheses). Our ASVD uses an exact SVD where ASVD4LLM's code uses a randomised one; our SVD-LLM "
           f"floors its Gram matrix at 1e-3 of its diagonal. KFAC-SVD is not in the paper.")
ls.save(table, "tab_llm_compression_mmlu", output_dir, params, caption=caption, label="tab:llm_compression_mmlu",
        notebook=NB, started=started)
display(Markdown(table.to_markdown(index=False)))

# %% [markdown]
# ## Fig. mmlu_avg: MMLU average against the achieved ratio

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
colors = dict(zip(["fwsvd", "asvd", "svd_llm", "basis_sharing", "gfwsvd", "kfac_svd"], plt.cm.tab10.colors))
for ax, block in zip(axes, ("paper", "best")):
    for m in dict.fromkeys([*methods, *extra_methods]) if "mmlu_average" in df else ():
        d = df[(df.method == m) & (df.block == block)].sort_values("ratio")
        if len(d):
            ax.errorbar(100 * d["ratio"], d["mmlu_average"], yerr=2 * d["mmlu_average_se"], marker="o", capsize=2,
                        color=colors[m], label=ls.NAMES[m])
    ax.axhline(dense["mmlu_average"], color="k", lw=1, ls=":", label="dense model")
    ax.axhspan(dense["mmlu_average"] - 2 * dense["mmlu_average_se"], dense["mmlu_average"] + 2 * dense["mmlu_average_se"],
               color="k", alpha=0.08, label="dense ± 2 se")
    ax.axhline(chance, color="tab:red", lw=1, ls="--", label="chance (0.25)")
    ax.set_title(ls.BLOCKS[block])
    ax.set_xlabel("whole-model compression ratio (%)")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("5-shot MMLU average (acc, ± 2 se)")
axes[0].legend(fontsize="x-small")
fig.suptitle(f"{model_name}: MMLU against compression ({limit_txt})")
fig.tight_layout()
figures.save_figure(fig, "fig_mmlu_avg", output_dir, params, started=started, notebook=NB);

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
others = [m for m in methods if m != "gfwsvd"]
for block in ("paper", "best"):
    cmp = ls.compare(df, ratios, "gfwsvd", others, block=block, accuracy="mmlu_average")
    verdict[f"gfwsvd_beats_{block}"] = cmp
    for target in ratios:
        c = [x for x in cmp if x["target"] == target]
        won = [ls.NAMES[x["other"]] for x in c if x["beats"]]
        gaps_txt = ", ".join(f"{ls.NAMES[x['other']]} {x['acc_diff']:+.3f} ± {x['acc_se']:.3f}" for x in c
                             if "acc_diff" in x)
        lines.append(f"* {ls.BLOCKS[block]}, {100 * target:g} %: GFWSVD beats {', '.join(won) or 'none'} on both "
                     f"perplexities" + (" and MMLU" if score_rows else "")
                     + (f"; its MMLU gaps: {gaps_txt}" if gaps_txt else "") + ".")
    if score_rows:
        beyond = [x for x in cmp if x.get("acc_beyond_se")]
        lines.append(f"* {ls.BLOCKS[block]}: {len(beyond)} of {len(cmp)} MMLU gaps lie beyond two standard errors.")
scored = df[~df["infeasible"]] if "infeasible" in df else df
at_chance = [(r["block"], r["target"], r["method"]) for _, r in scored.iterrows()
             if score_rows and ls.chance_level(r["mmlu_average"], r["mmlu_average_se"], chance)]
verdict.update(at_chance=at_chance, dense_at_chance=dense_at_chance, rows_scored=score_rows)
dense_txt = (f"the dense model ({dense['mmlu_average']:.3f} ± {dense['mmlu_average_se']:.3f}, "
             f"{int(dense['mmlu_average_n'])} questions) {'cannot' if dense_at_chance else 'can'} be told from chance")
if score_rows:
    lines.append(f"* MMLU cannot tell {len(at_chance)} of {len(scored)} compressed rows from chance (within two "
                 f"standard errors of {chance}); {dense_txt}.")
else:
    lines.append(f"* **MMLU cannot inform at this scale**: the dense model's accuracy is {dense['mmlu_average']:.3f} ± "
                 f"{dense['mmlu_average_se']:.3f} on {int(dense['mmlu_average_n'])} questions, no more than two "
                 f"standard errors above chance ({chance}), so "
                 f"no compressed row was scored on it, and the paper's MMLU claims cannot be tested here; the "
                 f"perplexity columns still compare the methods.")
# Does the lead grow as the ratio decreases? The change of the lead between the smallest and the largest ratio,
# as ls.gap gives it for two independent gaps (their models differ; they share the questions).
gaps, lead_change = {}, {}
for m in ("fwsvd", "asvd"):
    c = [x for x in verdict["gfwsvd_beats_paper"] if x["other"] == m and "acc_diff" in x]
    g = [x["acc_diff"] for x in c]
    gaps[m] = g
    if len(g) >= 2:
        d = ls.gap(c[0]["acc_diff"], c[0]["acc_se"], c[-1]["acc_diff"], c[-1]["acc_se"])
        change, se, told = d["diff"], d["se"], d["beyond"]
        lead_change[m] = {"change": change, "se": se, "beyond_2se": told}
        lines.append(f"* GFWSVD's MMLU lead over {ls.NAMES[m]} at {100 * ratios[0]:g} % ({g[0]:+.3f}) against "
                     f"{100 * ratios[-1]:g} % ({g[-1]:+.3f}): the paper says it grows as the ratio decreases; here it "
                     f"{'does' if change > 0 else 'does not'}, by {change:+.3f} ± {se:.3f}, "
                     + ("beyond two standard errors." if told else
                        "within two standard errors: at this sample MMLU cannot tell whether it grows."))
coll = ls.collapsed(df, dense, collapse_multiple)
lines.append(f"* Collapsed rows (a perplexity above {collapse_multiple:g}x the dense model's): {len(coll)} of {len(df)}"
             + (": " + ", ".join(sorted({f"{ls.NAMES[c['method']]} at {100 * c['target']:g} %" for c in coll}))
                if coll else "") + ".")
first_cost = lc.first_seconds(study.first)
lines.append(ls.cost_line(first_cost, study.timings))
verdict.update(collapsed=coll, lead_over=gaps, lead_change=lead_change, dense=dense, selections=sel.to_dict("records"),
               timings=study.timings, first_seconds=first_cost, cached=study.cached)
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "tab_llm_compression_mmlu_summary",
                         figures.provenance("tab_llm_compression_mmlu_summary", params, started=started, notebook=NB,
                                            extra={"verdict": verdict, "lines": lines,
                                                   "rows": df.drop(columns=["label"]).to_dict("records")}));
