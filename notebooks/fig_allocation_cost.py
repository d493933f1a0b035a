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
# # Rank allocation: quality against cost (beyond the paper)
#
# **Claim (paper Sec. 6.3; this study goes beyond the paper).** The paper allocates GFWSVD's per-layer ranks
# with ASVD's sensitivity sweep: every layer compressed alone at every candidate ratio, one held-out evaluation
# each. The question here: does Theorem 1's free loss curve of each layer, put on a common scale by **one**
# measured point per layer (the `calibrated` allocation), do as well as the better of the sweep and the free
# `fisher` allocation with at most a third of the sweep's evaluations, and better than LEMS?

# %% [markdown]
# ## Experiment
#
# Theorem 1 predicts each layer's loss increase for free (`0.5 sum_{i>r} s~_i^2`, the `fisher` allocation), in
# each layer's own Fisher metric, which orders one layer's compressions well but puts different layers on
# different scales (`fig_rank_allocation`). The `calibrated` allocation keeps Theorem 1's curve and takes each
# layer's scale from **one** measured point (the held-out loss increase, or the KL divergence from the dense
# outputs, with that layer alone at half its weights), then solves the budget exactly (integer program, HiGHS).
# LEMS (Thoma et al., ICML 2026) does the same with the tail energy of the singular values as the shape, a KL
# point at 10 % of the rank and a depth bias; `lems` is our reimplementation.
#
# **Embedded default.** SmolLM2-135M with the decoder tables' protocol and caches
# (`tab_llm_compression_main`: k = 32 calibration batches of 2 x 256 C4 tokens; the sweep and the one-point
# measurements on the same 2 held-out batches; ASVD's candidates 0.1-0.6). GFWSVD, KFAC-SVD and SVD-LLM under
# the six allocations, ASVD with uniform and its own sweep, at 5-30 % of the whole model's parameters removed.
#
# **How to read.** Fig. `fig_allocation_cost`: PTB perplexity (lower is better) against the model evaluations
# each allocation spent, one panel per ratio. Tab. `tab_allocation_cost`: every case. The verdicts at the end
# (the target: `calibrated` at most the better of `sensitivity` and `fisher` at 10 % and 20 % for every method,
# with at most a third of the sweep's evaluations, and ahead of `lems`) are computed from these numbers, for
# whichever measured point (loss or KL) the rows show works better.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make fig_allocation_cost`); the paper-scale value in the comment
# (`PROFILE=paper`). CPU cost of the default: see notebooks/params/fig_allocation_cost.default.yaml.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-2-7b-chat-hf"
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
ratios = [0.05, 0.1, 0.15, 0.2, 0.3]  # paper: same
methods = ["gfwsvd", "kfac_svd", "svd_llm"]  # paper: same
allocations = ["uniform", "fisher", "sensitivity", "lems", "calibrated", "calibrated_kl"]  # paper: same
asvd_allocations = ["uniform", "sensitivity"]  # ASVD with its own sweep; paper: same
target_ratios = [0.1, 0.2]  # the ratios of the target; paper: same

# %% tags=["hide-input"]
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.experiments import allocation_cost as ac
from fisherkron.repro import figures
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls
from fisherkron.hf.allocation import fisher_curves

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
NB = "notebooks/fig_allocation_cost.py"
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "calib_docs", "k", "batch_size", "seq_len", "seed", "sweep_docs",
                    "heldout_k", "select_k", "layers", "eval_tokens", "eval_seq_len", "sens_ratios", "mff_tol",
                    "ratios", "methods", "allocations", "asvd_allocations", "target_ratios")}
proto = lc.Protocol.from_params(params)
study = lc.prepare(proto, target="fig_allocation_cost")
dense = ls.flatten(study.scores(lc.Case("dense", "dense", 0.0), ("heldout", "ppl")))
print(f"dense: Wikipedia {dense['ppl_wiki']:.2f}, PTB {dense['ppl_ptb']:.2f}, held-out loss {dense['loss']:.4f}; "
      f"{len(study.names)} layers; the sensitivity allocation reaches at most {study.sensitivity_reach():.1%}")

# %% [markdown]
# ## The cases
# Method by method (each method's weighted SVDs computed once), every allocation at every ratio it can reach;
# every score, sweep and one-point measurement is cached.

# %% tags=["hide-input"]
plan = {m: list(allocations) for m in methods}
if asvd_allocations:
    plan["asvd"] = list(asvd_allocations)
rows, curves = [], {}
for m in plan:  # Theorem 1's curves of a method read its weighted SVDs while the study still holds them
    rows += ac.run_grid(study, [m], plan, ratios)
    if m in methods:
        curves[m], _ = fisher_curves(study.model, m, study.stats, study.names, mff_options=study.mff_options,
                                     decompositions=study.decompositions_of(m))
df = pd.DataFrame(rows)
df["ppl_ptb_x"] = df["ppl_ptb"] / dense["ppl_ptb"]
cols = ["method", "allocation", "target", "ratio", "ppl_wiki", "ppl_ptb", "ppl_ptb_x", "loss", "evaluations",
        "seconds"]
table = df[cols].rename(columns={"target": "target ratio", "ratio": "measured ratio",
                                 "ppl_wiki": "Wikipedia ppl", "ppl_ptb": "PTB ppl", "ppl_ptb_x": "PTB / dense",
                                 "loss": "held-out loss", "evaluations": "allocation evaluations",
                                 "seconds": "allocation seconds"})
caption = (f"{model_name}: every allocation of every method at {', '.join(f'{100 * t:g} %' for t in ratios)} of the "
           f"whole model's parameters removed (k = {k} calibration batches of {batch_size} x {seq_len} tokens); "
           f"perplexity on the first {eval_tokens:,} tokens of a Wikipedia text and of PTB test (dense "
           f"{dense['ppl_wiki']:.2f} / {dense['ppl_ptb']:.2f}); held-out loss on {select_k} selection batches (dense "
           f"{dense['loss']:.4f}); model evaluations and seconds each allocation spent (seconds as first measured).")
# make verify: ranks decided near a threshold or by the integer program can move with float32 differences between
# CPUs, so the measured ratio and the perplexities get a relative tolerance, the configuration none
tolerances = {"method": "exact", "allocation": "exact", "target ratio": "exact", "measured ratio": "rel=1e-3",
              "Wikipedia ppl": "rel=0.05", "PTB ppl": "rel=0.05", "PTB / dense": "rel=0.05", "held-out loss": "abs=0.02",
              "allocation evaluations": "exact", "allocation seconds": "timing"}
figures.save_table(table, "tab_allocation_cost", output_dir, params, caption=caption, label="tab:allocation_cost",
                   notebook=NB, started=started, tolerances=tolerances)
display(Markdown(table.to_markdown(index=False, floatfmt=".4g")))

# %% [markdown]
# ## Quality against cost
# One panel per ratio: each point is one (method, allocation); further left spent fewer model evaluations,
# lower is better. The dotted line is the dense model; a point above 100x its perplexity sits on the top edge
# with its value.

# %% tags=["hide-input"]
colors = {"gfwsvd": "C3", "kfac_svd": "C0", "svd_llm": "C2", "asvd": "C7"}
markers = {"uniform": "o", "fisher": "s", "sensitivity": "^", "lems": "D", "calibrated": "*", "calibrated_kl": "P"}
# the y range holds every point within 100x the dense model; a point beyond it (ASVD with one ratio in every layer)
# is drawn on the top edge with its value
top = dense["ppl_ptb"] * min(100.0, 1.3 * df["ppl_ptb_x"].max())
fig, axes = plt.subplots(1, len(ratios), figsize=(3.2 * len(ratios), 3.8), sharey=True, squeeze=False)
for ax, t in zip(axes[0], ratios):
    d = df[np.isclose(df.target, t)]
    for _, r in d.iterrows():
        x, y = max(r["evaluations"], 0.5), r["ppl_ptb"]
        ax.scatter(x, min(y, top), color=colors.get(r["method"], "k"),
                   marker=markers[r["allocation"]], s=90 if r["allocation"].startswith("calibrated") else 40,
                   edgecolor="k", linewidth=0.4, zorder=3, clip_on=False)
        if y > top:
            ax.annotate(f"{y:.2g}", (x, top), textcoords="offset points", xytext=(7, -3), fontsize="x-small")
    ax.axhline(dense["ppl_ptb"], color="k", ls=":", lw=1)
    ax.set_ylim(0.8 * dense["ppl_ptb"], top)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_title(f"{100 * t:g} % removed")
    ax.set_xlabel("model evaluations spent\n(free allocations drawn at 0.5)")
axes[0][0].set_ylabel("PTB perplexity")
handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=m) for m, c in colors.items() if m in plan]
handles += [plt.Line2D([], [], color="0.4", marker=mk, ls="", label=a) for a, mk in markers.items()
            if any(a in v for v in plan.values())]
fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize="small", frameon=False,
           bbox_to_anchor=(0.5, 1.06))
fig.tight_layout()
figures.save_figure(fig, "fig_allocation_cost", output_dir, params, started=started, notebook=NB);

# %% [markdown]
# ## Does one measured point per layer put the layers on one scale?
# For each method, every case's predicted loss increase (the sum over layers of Theorem 1's curve at the chosen
# ranks, raw and scaled by the `calibrated` allocation's per-layer factors) against the measured held-out loss
# increase; Spearman's rank correlation over the method's whole allocations (all allocations and ratios).

# %% tags=["hide-input"]
pred_rows, rho = [], {}
for m in methods:
    mine = [r for r in rows if r["method"] == m]
    rho[m] = {"cases": len(mine)}
    for variant in ("calibrated", "calibrated_kl"):  # the curves scaled by each variant's per-layer factors
        cal = [r for r in mine if r["allocation"] == variant and r.get("scales")]
        p = ac.predictions(mine, curves[m], dense["loss"], scales=cal[0]["scales"] if cal else None)
        rho[m]["raw"] = ac.spearman([x["predicted_raw"] for x in p], [x["measured"] for x in p])
        rho[m][variant] = ac.spearman([x["predicted_calibrated"] for x in p], [x["measured"] for x in p])
        if variant == "calibrated":
            pred_rows += p
pred = pd.DataFrame(pred_rows)
fig2, axes2 = plt.subplots(1, 2, figsize=(10, 4.2))
for ax, col, name in ((axes2[0], "predicted_raw", "raw Theorem-1 curves"),
                      (axes2[1], "predicted_calibrated", "calibrated curves")):
    for m in methods:
        d = pred[pred.method == m]
        ax.scatter(d[col], d["measured"].clip(lower=1e-4), color=colors[m], s=18,
                   label=f"{m} (Spearman {rho[m]['raw' if col == 'predicted_raw' else 'calibrated']:.2f})")
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel(f"predicted loss increase, {name}")
    ax.set_title(name)
    ax.legend(fontsize="x-small")
axes2[0].set_ylabel("measured held-out loss increase (nats)")
fig2.tight_layout()
figures.save_figure(fig2, "fig_allocation_prediction", output_dir, params, started=started, notebook=NB,
                    extra={"spearman": rho});

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
# which measured point puts the layers on one scale better: the held-out loss increase or the KL divergence from
# the dense outputs; the target is checked for whichever the study shows works better
duel = ac.head_to_head(rows, "calibrated_kl", "calibrated", methods, ratios)
better = "calibrated_kl" if duel["geomean"] < 1 else "calibrated"
got = ac.target(rows, methods, target_ratios, calibrated=better)
other = ac.target(rows, methods, target_ratios, calibrated="calibrated" if better == "calibrated_kl" else "calibrated_kl")
lines, verdict = [], {"target": got, "target_other": other, "calibrated_variant": better, "head_to_head": duel,
                      "spearman": rho}
lines.append(f"* Calibrated by the KL divergence against by the held-out loss: PTB lower in {duel['wins']['calibrated_kl']} "
             f"of {duel['pairs']} (method, ratio) pairs, higher in {duel['wins']['calibrated']}; geometric mean of the "
             f"ratio {duel['geomean']:.2f}. The target below is checked for `{better}`.")
for m in methods:
    for t in target_ratios:
        g = got[m][t]
        if g["calibrated"] is None:
            lines.append(f"* {m} at {100 * t:g} %: no calibrated case.")
            continue
        ev_c, ev_s = g["evaluations"]
        parts = [f"{better} PTB {g['calibrated']:.4g}"]
        if g["better_of_sweep_fisher"] is not None:
            how = "quality met" if g["quality"] else f"above it by {100 * g['shortfall']:.1f} %"
            parts.append(f"better of sweep and fisher {g['better_of_sweep_fisher']:.4g} ({how})")
        if ev_s is not None:
            parts.append(f"{ev_c} evaluations against the sweep's {ev_s} ({ev_c / ev_s:.2f}; cost "
                         f"{'met' if g['cost'] else 'missed'})")
        if g["lems"] is not None:
            parts.append(f"LEMS {g['lems']:.4g} ({'beaten' if g['beats_lems'] else 'not beaten'})")
        status = {True: "**met**", False: "**missed**", None: "**not decided** (a row is missing)"}[g["met"]]
        lines.append(f"* {m} at {100 * t:g} %: " + "; ".join(parts) + f": target {status}.")
met = [g["met"] for m in methods for g in got[m].values()]
verdict["target_met_everywhere"] = bool(all(v is True for v in met))
met_other = [g["met"] for m in methods for g in other[m].values()]
lines.append(f"* Target met by `{better}` in {sum(v is True for v in met)} of {len(met)} (method, ratio) pairs; by the "
             f"other variant in {sum(v is True for v in met_other)} of {len(met_other)}.")
for m in methods:
    lines.append(f"* {m}: whole allocations ordered by Theorem 1's raw curves with Spearman {rho[m]['raw']:.2f}, by "
                 f"the curves calibrated by the loss with {rho[m]['calibrated']:.2f}, by the KL with "
                 f"{rho[m]['calibrated_kl']:.2f} ({rho[m]['cases']} cases).")
for t in ratios:
    d = df[np.isclose(df.target, t)]
    if len(d):
        b = d.loc[d["ppl_ptb"].idxmin()]
        lines.append(f"* Best at {100 * t:g} %: {b['method']} with {b['allocation']} (PTB {b['ppl_ptb']:.4g}, "
                     f"{b['ppl_ptb'] / dense['ppl_ptb']:.2f}x dense).")
# what the study costs from empty caches (beyond the decoder tables' calibration and sweeps, which it shares):
# each one-point allocation's measurements and every score, as first measured
points = df[df["kind"] == "one point"].groupby(["method", "allocation"])["seconds"].first()
first_cost = lc.first_seconds(study.first)
lines.append(f"* One-point measurements: {points.sum() / 60:.0f} min for the {len(points)} (method, allocation) pairs "
             f"that take them (as first measured); the sensitivity sweeps, shared with the decoder tables, "
             f"{df[df['kind'] == 'sweep'].groupby('method')['seconds'].first().sum() / 60:.0f} min.")
lines.append(ls.cost_line(first_cost, study.timings))
verdict.update(dense=dense, timings=study.timings, cached=study.cached, first_seconds=first_cost,
               point_seconds=float(points.sum()))
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "fig_allocation_cost_summary",
                         figures.provenance("fig_allocation_cost_summary", params, started=started, notebook=NB,
                                            extra={"verdict": verdict, "lines": lines,
                                                   "rows": [{k_: v for k_, v in r.items() if k_ not in
                                                             ("ranks", "predicted", "scales")} for r in rows]}));
