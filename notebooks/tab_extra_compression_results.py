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
# # A weighted SVD as the start of an optimisation pipeline: learned truncation and LoRA recovery (paper Sec. 6.4, Tab. extra-compression-results)
#
# **Claim (paper Sec. 6.4).** Put into the Dobi-SVD pipeline in place of SVD, GFWSVD does better: on
# Llama-2-7B-chat "fine-tuned for 20 epochs", Dobi-GFWSVD is ahead of Dobi-SVD at 20 % (WikiText-2 7.56 vs
# 7.75, PTB 25.95 vs 26.11) and at 40 % (10.29 vs 10.56, 38.56 vs 41.70), with equal or better ARC-E,
# ARC-C, PIQA and HellaSwag. The question a user asks beside it: does a Fisher-weighted start still matter
# once the model is trained after compression?

# %% [markdown]
# ## Experiment
#
# **Embedded default.** SmolLM2-135M with the decoder study's protocol
# (`tab_llm_compression_main`: the same calibration entry, held-out C4 batches, evaluation texts and
# zero-shot example limits). For SVD, SVD-LLM and GFWSVD, at each whole-model ratio, three rows:
# * **(a)** the method's weighted SVD at its allocated per-layer ranks (`allocation`, the Fisher-predicted
#   allocation: no model evaluation);
# * **(b) Dobi-X**: Dobi-SVD's learned truncation: one position per layer trained through the soft mask
#   `0.5 tanh(beta (gamma - i)) + 0.5` on the decomposition's singular values, opened to the dense weight
#   by a second gate once the position passes the largest rank that saves parameters (where the built
#   model keeps the layer dense: the soft model trained is the model materialised), every weight frozen,
#   loss = LM term + `lambda |ratio - target|` (Dobi's lambda, beta and learning rates; the LM term is Dobi's
#   perplexity or the NLL, `trunc_lm_loss`, see the parameter file for the choice), started at (a)'s
#   ranks (`trunc_init`; Dobi starts uniform), then the layers rebuilt at the learned ranks so that the
#   ratio is met exactly;
# * **(c) Dobi-X + LoRA**: LoRA on (b)'s two factors (SVD-LLM's settings), merged so the ratio survives;
#   for `rebalance_methods` at `rebalance_ratios` also with each factor pair rebalanced to equal norms
#   first (GFWSVD's `L_B^-T U S^1/2` and `S^1/2 V^T L_A^-1` are not balanced).
#
# The ratio is the fraction of the whole model's parameters removed (embeddings included), the reading of
# "20 %" / "40 %" this package takes everywhere (Dobi's own `target_ratio` is the fraction kept, and a
# memory ratio with its remapping). Training text: C4 documents of the calibration's share that share no
# 100-letter span with a calibration window, a held-out document or any evaluation text (checked below);
# each seed draws its own training windows, the same for every method. Everything is
# `fisherkron.experiments.extra_compression` (rows, cache, aggregation, verdicts) on top of
# `fisherkron.hf.truncation` and `fisherkron.hf.recovery`; this notebook calls them and plots.
#
# **How to read.** Tab. `tab_extra_compression_results`: per ratio, a block per stage; perplexities (lower
# is better) and accuracies (higher is better) as mean ± standard deviation over the seeds (the (a) rows
# are deterministic), best per block in bold. Fig. `fig_extra_compression_training`: the training curves
# (learned truncation's perplexity term and soft ratio, LoRA's loss) per method, the line the mean over
# seeds and the band their range. The verdicts at the end are computed from these numbers.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make tab_extra_compression_results`); the paper-scale value in the comment
# (`PROFILE=paper`). CPU cost of the default: see notebooks/params/tab_extra_compression_results.default.yaml.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-2-7b-chat-hf"
calib_docs = 500  # the decoder study's calibration (its cache entry is shared); paper: 30000
k = 32  # paper: 75
batch_size = 2  # paper: 128
seq_len = 256  # paper: 2048
seed = 0
sweep_docs = 40  # paper: 600
heldout_k = 2  # paper: 1
select_k = 4  # selection batches: the C4 held-out loss of every row; paper: 1
layers = None  # every linear layer of the blocks; paper: None
eval_tokens = 4096  # first tokens of each evaluation text (0: all); paper: 0
eval_seq_len = 512  # paper: 2048
mff_tol = 0.0001  # paper: 0.0001
zero_shot_limit = 40  # examples per zero-shot task, the decoder tables' (None: all); paper: None
lm_eval_batch_size = 16  # paper: 16
evaluations = ["heldout", "ppl", "zeroshot"]  # paper: same
ratios = [0.2, 0.4]  # whole-model fraction of parameters removed; paper: same
fallback_ratio = 0.1  # added when every row at the largest ratio collapsed; paper: 0.1
methods = ["svd", "svd_llm", "gfwsvd"]  # paper: same
allocation = "fisher"  # the ranks of (a) and the start of (b); paper: "fisher"
seeds = [0, 1, 2]  # paper: [0, 1]
rebalance_methods = ["gfwsvd"]  # LoRA also after rebalancing the factors; paper: ["svd_llm", "gfwsvd"]
rebalance_ratios = [0.2]  # where the rebalanced LoRA rows run; paper: [0.2, 0.4]
trunc_init = "allocated"  # (a)'s ranks, or "uniform" (Dobi's start); paper: "allocated"
train_text = "c4"  # paper: "wikitext2" (Dobi's, train split)
train_k = 32  # training batches per seed; paper: 256
train_batch_size = 2  # paper: 1
train_seq_len = 256  # paper: 2048
trunc_steps = 32  # paper: 640 (20 epochs of 256 sequences, 8 per step)
trunc_accumulate = 1  # paper: 8
trunc_lr = 5.0  # Dobi's; paper: 5.0
trunc_min_lr = 4.0  # Dobi's; paper: 4.0
trunc_lam = 200.0  # Dobi's; paper: 200.0
trunc_beta = 10.0  # Dobi's; paper: 10.0
trunc_lm_loss = "nll"  # "perplexity" is Dobi's (see the parameter file); paper: "perplexity"
trunc_keep = "final"  # paper: "final"
lora_steps = 20  # paper: 64 (2 epochs of 256 sequences, 8 per step)
lora_accumulate = 1  # paper: 8
lora_lr = 0.0001  # SVD-LLM's; paper: 0.0001
lora_rank = 8  # SVD-LLM's; paper: 8
lora_alpha = 16.0  # SVD-LLM's; paper: 16.0
lora_dropout = 0.05  # SVD-LLM's; paper: 0.05
lora_warmup = 0.05  # fraction of the steps; paper: 0.05
collapse_multiple = 10.0  # a row "collapsed" when a perplexity exceeds this multiple of the dense model's
lead_tol = 0.01  # nats: a lead change smaller than this (or than the seed range) is no change
curve_smooth = 5  # steps of the running mean of the training curves

# %% tags=["hide-input"]
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.experiments import extra_compression as xc
from fisherkron.repro import figures
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
NB = "notebooks/tab_extra_compression_results.py"
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "calib_docs", "k", "batch_size", "seq_len", "seed", "sweep_docs",
                    "heldout_k", "select_k", "layers", "eval_tokens", "eval_seq_len", "mff_tol", "zero_shot_limit",
                    "lm_eval_batch_size", "evaluations", "ratios", "fallback_ratio", "methods", "allocation", "seeds",
                    "rebalance_methods", "rebalance_ratios", "trunc_init", "train_text", "train_k", "train_batch_size",
                    "train_seq_len", "trunc_steps", "trunc_accumulate", "trunc_lr", "trunc_min_lr", "trunc_lam",
                    "trunc_beta", "trunc_lm_loss", "trunc_keep", "lora_steps", "lora_accumulate", "lora_lr",
                    "lora_rank", "lora_alpha", "lora_dropout", "lora_warmup", "collapse_multiple", "lead_tol",
                    "curve_smooth")}
proto = lc.Protocol.from_params(params)
training = xc.Training(allocation=allocation, init=trunc_init, text=train_text, train_k=train_k,
                       batch_size=train_batch_size, seq_len=train_seq_len, trunc_steps=trunc_steps,
                       trunc_accumulate=trunc_accumulate, lr=trunc_lr, min_lr=trunc_min_lr, lam=trunc_lam,
                       beta=trunc_beta, lm_loss=trunc_lm_loss, keep=trunc_keep, lora_steps=lora_steps,
                       lora_accumulate=lora_accumulate, lora_lr=lora_lr, lora_rank=lora_rank, lora_alpha=lora_alpha,
                       lora_dropout=lora_dropout, warmup=lora_warmup)
ex = xc.prepare(proto, training)
dense = xc.flat_scores(ex.dense(evaluations))
d = ex.disjoint
print(f"{len(ex.study.names)} layers, k = {ex.study.stats.k}; dense: Wikipedia {dense['ppl_wiki']:.2f}, "
      f"PTB {dense['ppl_ptb']:.2f}")
print(f"training text ({d['text']}): {d['kept']} of {d['candidates']} documents kept; dropped for a shared "
      f"{d['span']}-letter span: {d['dropped'] or 'none'} (against {d['calibration_windows']} calibration windows, "
      f"the held-out documents and {d['evaluation_sources']} evaluation texts)")
per_batch = train_batch_size * train_seq_len
print(f"per seed: {train_k} x {train_batch_size} x {train_seq_len} = {train_k * per_batch:,} training tokens; "
      f"truncation {trunc_steps} steps x {trunc_accumulate} = {trunc_steps * trunc_accumulate * per_batch:,} tokens, "
      f"LoRA {lora_steps} steps x {lora_accumulate} = {lora_steps * lora_accumulate * per_batch:,} tokens")

# %% [markdown]
# ## The rows
# Method by method, at each ratio: (a), then per seed (b) and (c). Every score is written to
# `data/cache/studies/extra_compression/` as soon as it exists and every trained model is kept as its
# training checkpoint there (`runs/`), so the notebook can be stopped and rerun; (a) rows the decoder study
# already scored are read from its cache.

# %%
rows, records = xc.run_rows(ex, methods, ratios, seeds, rebalance_methods=rebalance_methods,
                            rebalance_ratios=rebalance_ratios, kinds=evaluations)
df = pd.DataFrame(rows)
fallback = bool(fallback_ratio) and xc.all_collapsed(df, dense, max(ratios), collapse_multiple)
if fallback:
    print(f"every row at {100 * max(ratios):g} % collapsed (a perplexity above {collapse_multiple:g}x the dense "
          f"model's): adding {100 * fallback_ratio:g} %")
    more, more_rec = xc.run_rows(ex, methods, [fallback_ratio], seeds, rebalance_methods=rebalance_methods,
                                 rebalance_ratios=rebalance_ratios, kinds=evaluations)
    rows, records = rows + more, records + more_rec
    df = pd.DataFrame(rows)
shown = sorted(set(ratios) | ({fallback_ratio} if fallback else set()))
agg = xc.aggregate(df)
cols = [c for c in (*xc.COLUMNS, "acc4") if c in df]

# %% [markdown]
# ## Tab. extra-compression-results

# %% tags=["hide-input"]
table = xc.results_table(agg, shown, dense, allocation, columns=cols)
limit_txt = "all examples" if zero_shot_limit is None else f"the first {zero_shot_limit} examples of each task"
start = "(a)'s ranks" if trunc_init == "allocated" else "the uniform allocation"
text_name = "C4" if train_text == "c4" else "WikiText-2 train"
caption = (f"{model_name} compressed by SVD, SVD-LLM and GFWSVD at {', '.join(f'{100 * t:g}' for t in shown)} % of "
           f"the whole model's parameters removed: (a) at the {allocation} allocation's ranks, (b) with Dobi-SVD's "
           f"learned truncation ({trunc_steps} steps of {trunc_accumulate} x {train_batch_size} x {train_seq_len} "
           f"{text_name} tokens, LM term {trunc_lm_loss}, started at {start}), (c) after LoRA recovery of (b)'s "
           f"factors ({lora_steps} steps, rank {lora_rank}). Perplexity of the first {eval_tokens:,} tokens of a "
           f"Wikipedia text (WikiText-2's role) and of PTB test ({eval_seq_len}-token windows); zero-shot accuracy "
           f"(lm-eval acc, {limit_txt}) and their mean over the four tasks. Trained rows: mean ± standard deviation "
           f"over {len(seeds)} seeds (training windows, order, LoRA initialisation). Best per block in bold.")
ls.save(table, "tab_extra_compression_results", output_dir, params, caption=caption,
        label="tab:extra-compression-results", notebook=NB, started=started, seeds=len(seeds))
display(Markdown(table.to_markdown(index=False)))

# %% [markdown]
# ## Training curves

# %% tags=["hide-input"]
curves = xc.training_curves(records)
colors = dict(zip(xc.METHODS, plt.cm.tab10.colors))
panels = [("truncation", "lm", "learned truncation: LM term" + (" (perplexity)" if trunc_lm_loss == "perplexity"
                                                               else " (NLL)")),
          ("truncation", "soft_ratio", "learned truncation: soft ratio"), ("recovery", "loss", "LoRA recovery: loss")]
fig, axes = plt.subplots(len(panels), len(shown), figsize=(5 * len(shown), 3.2 * len(panels)), squeeze=False)
for j, target in enumerate(shown):
    for i, (phase, col, title) in enumerate(panels):
        ax = axes[i][j]
        for (m, reb), g in curves[(curves.phase == phase) & np.isclose(curves.target, target)].groupby(
                ["method", "rebalance"], sort=False):
            wide = g.pivot_table(index="step", columns="seed", values=col)
            smooth = wide.rolling(curve_smooth, min_periods=1).mean()
            ax.plot(smooth.index, smooth.mean(axis=1), color=colors.get(m), ls="--" if reb else "-",
                    label=xc.row_name(m, "dobi" if phase == "truncation" else "lora", reb))
            ax.fill_between(smooth.index, smooth.min(axis=1), smooth.max(axis=1), color=colors.get(m), alpha=0.2)
        if col == "soft_ratio":
            ax.axhline(target, color="k", lw=1, ls=":", label="target")
        if col == "lm" and trunc_lm_loss == "perplexity":
            ax.set_yscale("log")
        ax.set_title(f"{100 * target:g} %: {title}", fontsize="small")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
fig.suptitle(f"{model_name}: training curves (running mean over {curve_smooth} steps; band: range over "
             f"{len(seeds)} seeds)")
fig.tight_layout()
figures.save_figure(fig, "fig_extra_compression_training", output_dir, params, started=started, notebook=NB);

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
texts = [c for c in ("ppl_wiki", "ppl_ptb") if c in df]
name = {"ppl_wiki": "Wikipedia", "ppl_ptb": "PTB"}
# 1. Dobi-GFWSVD against Dobi-SVD, beyond the seed spread
dobi = {}
for t in shown:
    res = {c: xc.ahead(df, t, "dobi", "gfwsvd", "svd", c) for c in texts + (["acc4"] if "acc4" in df else [])}
    dobi[t] = res
    sep = all(res[c]["separated"] for c in texts)
    lines.append(f"* {100 * t:g} %: Dobi-GFWSVD ahead of Dobi-SVD beyond the seed spread on both perplexities: "
                 f"**{'yes' if sep else 'no'}** ("
                 + "; ".join(f"{name[c]} {np.mean(res[c]['ours']):.4g} vs {np.mean(res[c]['other']):.4g}"
                             f"{' (every seed ahead)' if res[c]['separated'] else ' (seed ranges overlap)'}"
                             for c in texts)
                 + (f"; mean of the four accuracies {res['acc4']['diff']:+.3f}" if "acc4" in res else "") + ").")
both = all(all(dobi[t][c]["separated"] for c in texts) for t in ratios)
verdict["dobi_gfwsvd_ahead"] = {str(t): v for t, v in dobi.items()}
verdict["dobi_gfwsvd_ahead_at_every_ratio"] = both
lines.append(f"* Dobi-GFWSVD ahead of Dobi-SVD at {' and '.join(f'{100 * t:g} %' for t in ratios)} by more than the "
             f"seed spread: **{'yes' if both else 'no'}**.")
# 2. GFWSVD's lead before training, after learned truncation, after LoRA
changes = []
for other in [m for m in methods if m != "gfwsvd"]:
    for t in shown:
        for c in texts:
            before = xc.leads(df, t, "allocated", "gfwsvd", other, c)
            if not before:
                continue
            for stage in ("dobi", "lora"):
                ch = xc.lead_change(before[0], xc.leads(df, t, stage, "gfwsvd", other, c), lead_tol)
                changes.append({"other": other, "target": t, "text": c, "stage": stage, **ch})
ch_df = pd.DataFrame(changes)
verdict["lead_changes"] = changes
for other, g in ch_df.groupby("other", sort=False) if len(ch_df) else []:
    for t, gt in g.groupby("target"):
        lines.append(f"* GFWSVD's lead over {ls.NAMES[other]} at {100 * t:g} % (log-perplexity, nats; before -> "
                     f"after truncation -> after LoRA): "
                     + "; ".join(f"{name[c]} {gc.iloc[0]['before']:+.3f} -> "
                                 + " -> ".join(f"{r['after']:+.3f} ({r['verdict']})" for _, r in gc.iterrows())
                                 for c, gc in gt.groupby("text", sort=False)) + ".")
counts = ch_df.groupby(["stage", "verdict"]).size().to_dict() if len(ch_df) else {}
verdict["lead_change_counts"] = {f"{s}/{v}": int(n) for (s, v), n in counts.items()}
lines.append("* Lead changes over all (other method, ratio, text): " + "; ".join(
    f"after {'learned truncation' if s == 'dobi' else 'LoRA'}: "
    + ", ".join(f"{v} {n}" for (s2, v), n in counts.items() if s2 == s) for s in ("dobi", "lora")) + ".")
verdict["standing"] = xc.standing(ch_df, lead_tol) if len(ch_df) else {}
for other, st in verdict["standing"].items():
    lines.append(f"* GFWSVD against {ls.NAMES[other]} over every ratio, text and stage ((a), (b), (c)): behind in "
                 f"{st['behind']} of {st['of']} comparisons, level in {st['level']}, ahead in {st['ahead']} "
                 f"(a lead counts beyond its noise: {lead_tol:g} nats before training, max(seed spread, {lead_tol:g}) after).")
# 3. factor rebalancing before LoRA
reb = [xc.rebalance_effect(df, m, t, c, lead_tol) for m in rebalance_methods for t in shown for c in texts
       if any(np.isclose(t, rebalance_ratios))]
verdict["rebalancing"] = reb
if reb:
    lines.append("* Rebalancing the factors before LoRA (gain in log-perplexity, > 0 helps): " + "; ".join(
        f"{ls.NAMES[r['method']]} {100 * r['target']:g} % {name[r['column']]} {r.get('gain', float('nan')):+.4f} "
        f"({r['verdict']})" for r in reb) + ".")
# 4. collapse, fallback, budget drift
coll = ls.collapsed(df.assign(block=df["stage"], allocation=df["stage"]), dense, collapse_multiple)
verdict["collapsed"] = coll
verdict["fallback_ratio_added"] = fallback
lines.append(f"* Collapsed rows (a perplexity above {collapse_multiple:g}x the dense model's): {len(coll)} of {len(df)}"
             f"; the {100 * fallback_ratio:g} % fallback was {'added' if fallback else 'not needed'}.")
trained = df[df.stage == "dobi"]
if "soft_ratio" in trained and len(trained):
    drift = (trained["soft_ratio"] - trained["target"]).abs()
    verdict["soft_ratio_drift_max"] = float(drift.max())
    lines.append(f"* Learned truncation's soft ratio at its last step differs from the target by at most "
                 f"{100 * drift.max():.2f} percentage points; the budgeted ranks then meet it exactly (achieved "
                 f"{100 * trained['ratio'].min():.2f}-{100 * trained['ratio'].max():.2f} %).")
verdict.update(dense=dense, disjoint=ex.disjoint, timings=ex.timings, cached=ex.cached, ratios_shown=shown,
               aggregate=agg.to_dict("records"), training=training.truncation() | training.recovery())
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "tab_extra_compression_results_summary",
                         figures.provenance("tab_extra_compression_results_summary", params, started=started,
                                            notebook=NB, extra={"verdict": verdict, "lines": lines,
                                                                "rows": df.to_dict("records")}));
