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
# # Compressing a decoder at 20-50 % (paper Sec. 6.3: Tabs. Llama31_compression_50, Llama2_chat_compression_50)
#
# **Claim (paper Sec. 6.3).** "On Llama 2 7B and Llama 3.1 8B, and for compression levels up to 50 %,
# GFWSVD substantially outperforms methods that decompose layers independently, both diagonal FWSVD and
# activation-aware ASVD"; GFWSVD "outperforms Basis Sharing on Llama 3.1 8B at all compression levels".
# The tables report WikiText-2 and PTB perplexity and six zero-shot accuracies (± standard error) at
# whole-model ratios 20 / 30 / 40 / 50 %.

# %% [markdown]
# ## Experiment
#
# **Embedded default.** SmolLM2-135M (the Llama role; its weights were 4-bit quantised
# before we dequantised them; its embeddings are 21 % of its parameters, 4 % in Llama-2-7B) compressed
# by FWSVD, ASVD, SVD-LLM, Basis Sharing and GFWSVD, and KFAC-SVD (not in the paper), with one protocol
# for all: one calibration set (C4 documents, `k` batches, every statistic collected once), ASVD's
# sensitivity sweep on held-out C4 batches with ASVD's candidate per-layer ratios, the evaluation texts
# (a Wikipedia text in WikiText-2's role, PTB test) and tasks never seen by calibration, sweep or choice.
# Two blocks of rows per ratio:
# * **as the paper ran them**: GFWSVD with ASVD's sensitivity scores (its own sweep), ASVD with its own,
#   SVD-LLM uniform (its authors' code), FWSVD uniform (as the paper describes it), Basis Sharing with
#   its own rank rule;
# * **best allocation here**: each method with the better of its uniform / fisher / sensitivity
#   allocations, chosen on the loss of held-out selection batches (C4 documents that neither the
#   calibration nor the sweep saw), never on the evaluation texts.
#
# All of it is `fisherkron.experiments.llm_compression` (cases, cache, noise) and `llm_summary` (tables,
# verdicts); this notebook calls them and plots.
#
# **How to read.** Tab. `tab_llm_compression_main`: per ratio and block, perplexities (lower is better),
# accuracies ± standard error and their average (higher is better), best per block in bold; the
# compression ratio is the paper's `1 - compressed / original` with the ratio over the linear layers in
# parentheses. Fig. `fig_llm_compression`: average accuracy and perplexities against the achieved ratio.
# The sweep-noise table says whether the sweep's smallest loss changes stand above its noise. The
# verdicts at the end are computed from these numbers.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make tab_llm_compression_main`); the paper-scale value in the comment
# (`PROFILE=paper`). CPU cost of the default: see notebooks/params/tab_llm_compression_main.default.yaml.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-3.1-8B-Instruct" (and "meta-llama/Llama-2-7b-chat-hf")
calib_docs = 500  # C4 documents of the calibration; paper: 30000 FineWeb documents
k = 32  # calibration batches (one gradient each); paper: 75
batch_size = 2  # sequences per batch; paper: 128
seq_len = 256  # tokens per sequence; paper: 2048
seed = 0
sweep_docs = 40  # documents after the calibration's that give the sweep's batches (the rest: selection); paper: 600
heldout_k = 2  # sweep batches (batch_size x seq_len tokens each; the noise check below); paper: 1 (of 128 x 2,048)
select_k = 4  # selection batches; paper: 1 (of 128 x 2,048)
layers = None  # every linear layer of the blocks; paper: None
eval_tokens = 4096  # first tokens of each evaluation text (0: all); paper: 0
eval_seq_len = 512  # perplexity window; paper: 2048
sens_ratios = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]  # ASVD4LLM's candidates (0.9 ... 0.4 kept) as removed; paper: same
mff_tol = 0.0001  # MFF's target error; paper: 0.0001
zero_shot_limit = 40  # examples per zero-shot task (None: all); paper: None
lm_eval_batch_size = 16  # paper: 16
ratios = [0.2, 0.3, 0.4, 0.5]  # target whole-model ratios; paper: same
methods = ["fwsvd", "asvd", "svd_llm", "basis_sharing", "gfwsvd"]  # the paper's rows; paper: same
extra_methods = ["kfac_svd"]  # not in the paper; paper: same
noise_methods = ["gfwsvd", "asvd"]  # the sweeps whose noise is measured; paper: same
noise_layers = 8  # least sensitive layers re-measured for the sweep-noise check; paper: 8
collapse_multiple = 10.0  # a row "collapsed" when a perplexity exceeds this multiple of the dense model's

# %% tags=["hide-input"]
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.repro import figures
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
NB = "notebooks/tab_llm_compression_main.py"
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "calib_docs", "k", "batch_size", "seq_len", "seed", "sweep_docs",
                    "heldout_k", "select_k", "layers", "eval_tokens", "eval_seq_len", "sens_ratios", "mff_tol",
                    "zero_shot_limit", "lm_eval_batch_size", "ratios", "methods", "extra_methods", "noise_methods",
                    "noise_layers", "collapse_multiple")}
proto = lc.Protocol.from_params(params)
study = lc.prepare(proto, target="tab_llm_compression_main")
dense = ls.flatten(study.scores(lc.Case("dense", "dense", 0.0), ("heldout", "ppl", "zeroshot")))
limit_txt = "all examples" if zero_shot_limit is None else f"the first {zero_shot_limit} examples of each task"
reach = study.sensitivity_reach()
print(f"{len(study.names)} layers, k = {study.stats.k}; dense: Wikipedia {dense['ppl_wiki']:.2f}, PTB "
      f"{dense['ppl_ptb']:.2f}, zero-shot average {dense['average']:.3f} ± {dense['average_se']:.3f} ({limit_txt}); "
      f"the sensitivity allocation reaches at most {reach:.1%} of the model with ASVD's candidates")

# %% [markdown]
# **Budget conventions.** ASVD4LLM's `--param_ratio_target p` keeps the fraction `p` of the weights of every
# `nn.Linear` of the model (its code walks all of them, `lm_head` included) and its candidates keep 0.4 ... 0.9
# of a layer; its compression ratio is `1 - p` over the linear layers. Ours is the paper's, `1 - compressed /
# original` over the whole model (embeddings included), over the blocks' linear layers (the paper's selection),
# each candidate the fraction of a layer removed (0.1 ... 0.6). The table gives both ratios of every row. With
# at most 60 % of each layer removed, the sensitivity allocation cannot reach the largest ratios of a model whose
# embeddings are a large share of it (printed above); such rows are marked out of reach.

# %% [markdown]
# ## The sweep's noise
# ASVD scores each layer on its calibration set of 32 x 2,048 tokens; our sweep scores on `heldout_k`
# held-out batches. For GFWSVD and ASVD the least sensitive layers at the gentlest candidate (10 % of a
# layer removed) are compressed alone again and their per-token loss differences measured on the
# selection batches (which the sweep did not see, so picking the layers on the sweep's numbers does not bias
# the re-measurement): `delta_sweep` is the sweep's change, `delta` the re-measured one (± `se_token_selection`),
# `sd_token` the spread of per-token loss differences, `se_token_sweep = sd_token / sqrt(sweep tokens)` the
# sweep's standard error (per token; the per-sequence one beside it), `z_sweep = delta / se_token_sweep`, and
# `tokens_needed = (2 sd_token / delta)^2` the tokens a change of that size needs to stand two standard errors
# above the noise (itself uncertain where `delta` is within a few `se_token_selection` of zero).

# %%
noise = pd.DataFrame([r | {"method": m} for m in noise_methods
                      for r in lc.sweep_noise(study, m, n_layers=noise_layers, progress=True)])
display(noise[["method", "layer", "rank", "delta_sweep", "delta", "se_token_selection", "sd_token", "se_token_sweep",
               "se_sequence_sweep", "z_sweep", "tokens_needed"]])
sweep_tokens = int(noise["sweep_tokens"].iloc[0])
above = float((noise["z_sweep"] >= 2).mean())
print(f"sweep on {sweep_tokens:,} tokens: {above:.0%} of the {len(noise)} least sensitive layer changes stand 2 "
      f"standard errors above the noise; median change {noise['delta'].median():.2e} nats, median standard error "
      f"{noise['se_token_sweep'].median():.2e}; median tokens needed {noise['tokens_needed'].median():,.0f}")

# %% [markdown]
# ## The grid
# Method by method, at each ratio: the held-out selection loss of each allocation (the choice of the
# "best" block), then the scores of the cases the table shows. Every score is written to
# `data/cache/studies/llm_compression/` as soon as it exists, so the notebook can be stopped and rerun.

# %%
rows, selections = lc.run_table(study, methods, ratios, ("heldout", "ppl", "zeroshot"), extra=extra_methods)
df = pd.DataFrame(rows)
sel = ls.selection_table(selections)
display(sel)

# %% tags=["hide-input"]
table = ls.main_table(df, ratios, dense)
caption = (f"{model_name} (4-bit-quantised weights, dequantised) compressed at "
           f"{', '.join(f'{100 * t:g}' for t in ratios)} %: perplexity of the first "
           f"{eval_tokens:,} tokens of a Wikipedia text (WikiText-2's role) and of PTB test ({eval_seq_len}-token "
           f"windows), zero-shot accuracy (lm-eval acc, {limit_txt}) ± standard error and their average. Calibration: "
           f"{k} batches of {batch_size} x {seq_len} C4 tokens; sweep: {heldout_k} held-out batches, ASVD's "
           f"candidates. "
           f"Best per block in bold. Compression ratio 1 - compressed/original (over the linear layers in "
           f"parentheses). Our ASVD uses an exact SVD where ASVD4LLM's code uses a randomised one (torch.svd_lowrank); "
           f"our SVD-LLM floors its Gram matrix at 1e-3 of its diagonal (PTB 878 against 882 without the floor at "
           f"10 %, k = 4). KFAC-SVD is not in the paper. With ASVD's candidates (at most 60 % of a layer removed) the "
           f"sensitivity allocation reaches at most {reach:.1%} of this model: rows beyond are out of reach.")
ls.save(table, "tab_llm_compression_main", output_dir, params, caption=caption, label="tab:llm_compression_main",
        notebook=NB, started=started)
display(Markdown(table.to_markdown(index=False)))

# %% [markdown]
# ## Fig. llm_compression: accuracy and perplexities against the achieved ratio

# %% tags=["hide-input"]
fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
colors = dict(zip(["fwsvd", "asvd", "svd_llm", "basis_sharing", "gfwsvd", "kfac_svd"], plt.cm.tab10.colors))
for block, ls_ in (("paper", "-"), ("best", "--")):
    for m in dict.fromkeys([*methods, *extra_methods]):
        d = df[(df.method == m) & (df.block == block)].sort_values("ratio")
        if d.empty:
            continue
        lab = f"{ls.NAMES[m]} ({ls.BLOCKS[block]})"
        axes[0].errorbar(100 * d["ratio"], d["average"], yerr=d["average_se"], ls=ls_, marker="o", color=colors[m],
                         label=lab, capsize=2)
        axes[1].plot(100 * d["ratio"], d["ppl_wiki"], ls=ls_, marker="o", color=colors[m])
        axes[2].plot(100 * d["ratio"], d["ppl_ptb"], ls=ls_, marker="o", color=colors[m])
axes[0].axhline(dense["average"], color="k", lw=1, ls=":", label="dense model")
axes[1].axhline(dense["ppl_wiki"], color="k", lw=1, ls=":")
axes[2].axhline(dense["ppl_ptb"], color="k", lw=1, ls=":")
axes[0].set_ylabel("average zero-shot accuracy (acc)")
axes[1].set_ylabel("Wikipedia-text perplexity (WikiText-2 role, log)")
axes[2].set_ylabel("PTB perplexity (log)")
for ax in axes:
    ax.set_xlabel("whole-model compression ratio (%)")
    ax.grid(alpha=0.3, which="both")
for ax in axes[1:]:
    ax.set_yscale("log")
axes[0].legend(fontsize="x-small", ncol=2)
fig.suptitle(f"{model_name}: solid = as the paper ran them, dashed = best allocation here ({limit_txt})")
fig.tight_layout()
figures.save_figure(fig, "fig_llm_compression", output_dir, params, started=started, notebook=NB);

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
others = [m for m in methods if m != "gfwsvd"]
for block in ("paper", "best"):
    cmp = ls.compare(df, ratios, "gfwsvd", others, block=block)
    verdict[f"gfwsvd_beats_{block}"] = cmp
    for target in ratios:
        c = [x for x in cmp if x["target"] == target]
        won = [ls.NAMES[x["other"]] for x in c if x["beats"]]
        lost = [f"{ls.NAMES[x['other']]} (PTB {'won' if x['ppl_ptb'] else 'lost'}, Wikipedia "
                f"{'won' if x['ppl_wiki'] else 'lost'}"
                + (f", accuracy {x['acc_diff']:+.3f} ± {x['acc_se']:.3f}"
                   f"{', beyond 2 se' if x['acc_beyond_se'] else ', within 2 se'}" if "acc_diff" in x else "")
                + ")" for x in c if not x["beats"]]
        lines.append(f"* {ls.BLOCKS[block]}, {100 * target:g} %: GFWSVD beats {', '.join(won) or 'none'}"
                     + (f"; not {'; '.join(lost)}" if lost else "") + ".")
    beyond = [x for x in cmp if x.get("acc_beyond_se")]
    lines.append(f"* {ls.BLOCKS[block]}: {len(beyond)} of {len(cmp)} accuracy gaps between GFWSVD and another method "
                 f"lie beyond two standard errors ({limit_txt}); perplexities are of fixed texts.")
slopes = ls.degradation(df, methods, block="paper")
finite = {m: v for m, v in slopes.items() if np.isfinite(v)}
fastest = max(finite, key=finite.get) if finite else None
verdict["degradation_slope_ptb"] = slopes
verdict["fwsvd_degrades_fastest"] = None if fastest is None else fastest == "fwsvd"
if fastest is None:
    lines.append("* Degradation against the ratio needs two ratios or more.")
else:
    lines.append(f"* Fastest degradation (slope of log PTB perplexity against the ratio, paper block): "
                 f"{ls.NAMES[fastest]}; FWSVD degrades fastest: **{'yes' if fastest == 'fwsvd' else 'no'}** ("
                 + ", ".join(f"{ls.NAMES[m]} {v:.1f}" for m, v in sorted(finite.items(), key=lambda kv: -kv[1]))
                 + ").")
coll = ls.collapsed(df, dense, collapse_multiple)
verdict["collapsed"] = coll
lines.append(f"* Collapsed rows (a perplexity above {collapse_multiple:g}x the dense model's): {len(coll)} of {len(df)}"
             + (": " + ", ".join(sorted({f"{ls.NAMES[c['method']]} at {100 * c['target']:g} %" for c in coll}))
                if coll else "") + ".")
paper_sel = sel[sel["method"].isin(list(lc.PAPER_ALLOCATION))]
changed = paper_sel[paper_sel["best"] != paper_sel["method"].map(lc.PAPER_ALLOCATION)]
changed_txt = ", ".join(f"{ls.NAMES[r.method]} at {100 * r.target:g} % ({r.best})" for r in changed.itertuples())
lines.append(f"* The best allocation here differs from the paper's for {len(changed)} of {len(paper_sel)} "
             f"(method, ratio) pairs" + (f": {changed_txt}" if len(changed) else "") + ".")
out = df[df["infeasible"]] if "infeasible" in df else df.iloc[:0]
verdict["out_of_reach"] = out[["block", "target", "method", "allocation"]].to_dict("records")
lines.append(f"* Out of reach of ASVD's candidates (at most {reach:.1%} of this model): "
             + (", ".join(f"{ls.NAMES[r.method]} [{r.allocation}] at {100 * r.target:g} % ({ls.BLOCKS[r.block]})"
                          for r in out.itertuples()) or "none") + ".")
lines.append(f"* Sweep noise: {above:.0%} of the least sensitive changes stand two standard errors above the noise "
             f"at {sweep_tokens:,} tokens.")
first_cost = lc.first_seconds(study.first)
lines.append(ls.cost_line(first_cost, study.timings))
verdict.update(dense=dense, sensitivity_reach=reach, sweep_noise=noise.to_dict("records"),
               selections=sel.to_dict("records"),
               timings=study.timings, first_seconds=first_cost, cached=study.cached, sweep_tokens=sweep_tokens,
               noise_above_2se=above)
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "tab_llm_compression_main_summary",
                         figures.provenance("tab_llm_compression_main_summary", params, started=started, notebook=NB,
                                            extra={"verdict": verdict, "lines": lines,
                                                   "rows": df.drop(columns=["label"]).to_dict("records")}));
