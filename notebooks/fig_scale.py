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
# # Why GFWSVD trails here: model size, architecture and the noise of its factors (beyond the paper)
#
# **Claim (paper Sec. 6.3, Tabs. Llama31_compression_50 and Llama2_chat_compression_50).** GFWSVD compresses
# Llama-2-7B and Llama-3.1-8B better than FWSVD, ASVD and SVD-LLM. On SmolLM2-135M, our only decoder so far,
# it trails SVD-LLM and KFAC-SVD. This study asks which of two explanations holds on three decoders of growing
# size and two architectures: **model size** (GFWSVD's gap to its best rival shrinks as the model grows) or
# **estimation noise** in MFF's Kronecker factors (shrinking them toward their diagonals closes the gap).

# %% [markdown]
# ## Experiment
#
# **Models.** Three real decoders that ship inside registry packages, each 4-bit-quantised before we
# dequantised it: SmolLM2-135M (Llama architecture), Gemma 3 270M (sliding-window attention, tied 262k-token
# embeddings) and Qwen2.5-Coder-0.5B-Instruct (Qwen2: biases on q/k/v, untied head). Their block linears, the
# layers every method compresses, hold about 106M, 100M and 358M parameters.
#
# **One protocol for all** (the decoder tables' protocol, with k = 8 calibration batches so that MFF of the largest
# model's factors and of their split halves takes about an hour on 2 cores): C4 calibration, held-out sweep batches
# for the one-point measurements, held-out selection batches, perplexity on the first 4,096 tokens of PTB test and
# of a Wikipedia text in 512-token windows. Each method runs with Theorem 1's free curves (`fisher`) and with the
# curves calibrated by one KL point per layer (`calibrated_kl`), at 10 % and 20 % of the whole model's parameters
# removed; where one allocation is needed, each method takes the one of lower held-out selection loss. The share of
# a model's block linears that a whole-model target removes grows with the share its embeddings hold (the table's
# "block linears removed"; Gemma's 262k-token embeddings are most of its parameters).
#
# **Shrunk GFWSVD** (`gfwsvd_shrunk`, not in the paper): MFF's `A`, `B` replaced by
# `(1 - lambda) A + lambda diag(A)`, with `lambda` for each factor of each layer estimated from the gradients
# themselves: MFF on the even and on the odd batches gives two estimates whose disagreement measures the noise
# of the off-diagonal entries (a Ledoit-Wolf-type rule, `fisherkron.core.shrinkage`).
#
# **Uncertainty.** Every case keeps the negative log-likelihood of each evaluation window, so a gap between
# two cases is a mean over the 16 windows of their paired differences, with its standard error.
#
# **How to read.** Fig. `fig_scale`, left: each method's PTB perplexity relative to the dense model against the
# model's block-linear parameters; right: GFWSVD's log-perplexity gap to its best rival (above zero: GFWSVD
# is behind) with two standard errors. Tab. `tab_scale`: every case. The verdicts are computed from these
# numbers.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make fig_scale`); the paper-scale value in the comment (`PROFILE=paper`).
# CPU cost of the default: see notebooks/params/fig_scale.default.yaml.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
models = ["smollm2", "gemma3-270m", "qwen2.5-0.5b"]  # paper: the two Llamas
calib_docs = 500  # paper: 30000
k = 8  # paper: 75
batch_size = 2  # paper: 128
seq_len = 256  # paper: 2048
seed = 0
sweep_docs = 40  # paper: 600
heldout_k = 1  # paper: 1
select_k = 4  # paper: 1
layers = None  # paper: None
eval_tokens = 4096  # paper: 0 (all)
eval_seq_len = 512  # paper: 2048
mff_tol = 0.0001  # paper: 0.0001
ratios = [0.1, 0.2]  # paper: same
methods = ["fwsvd", "asvd", "svd_llm", "kfac_svd", "gfwsvd", "gfwsvd_shrunk"]  # paper: same
allocations = ["fisher", "calibrated_kl"]  # paper: same
zero_shot_methods = ["svd_llm", "kfac_svd", "gfwsvd", "gfwsvd_shrunk"]  # at the largest ratio, calibrated_kl
zero_shot_limit = 100  # examples per zero-shot task (0: no zero-shot scores, None: all); paper: None
match_cut = True  # a model none of whose ratios cuts the first model's share of block linears gets one that does

# %% tags=["hide-input"]
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls
from fisherkron.experiments import scale as sc
from fisherkron.repro import figures

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
NB = "notebooks/fig_scale.py"
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "models", "calib_docs", "k", "batch_size", "seq_len", "seed", "sweep_docs", "heldout_k",
                    "select_k", "layers", "eval_tokens", "eval_seq_len", "mff_tol", "ratios", "methods", "allocations",
                    "zero_shot_methods", "zero_shot_limit", "match_cut")}
zs_cases = ([("dense", "dense", 0.0)] + [(m, "calibrated_kl", max(ratios)) for m in zero_shot_methods]
            if zero_shot_limit != 0 else [])

# %% [markdown]
# ## The cases
# Model by model (each calibrated once, cached), method by method; every score is cached, so an interrupted run
# resumes at the next case.

# %% tags=["hide-input"]
results = []
for name in models:
    proto = lc.Protocol.from_params({**params, "model_name": name})
    results.append(sc.run_model(proto, methods, allocations, ratios, zero_shot=zs_cases))
# A matched cut: every removed parameter comes from the block linears, so a whole-model ratio t removes
# t x params / block_params of them. A model none of whose ratios is within a quarter of the first model's share at
# the largest ratio gets the ratio that matches it (its cases kept apart, no zero-shot scores).
ref_cut = max(ratios) * results[0]["params"] / results[0]["block_params"]
for res in results[1:] if match_cut else []:
    per = res["params"] / res["block_params"]
    if all(abs(t * per - ref_cut) > 0.25 * ref_cut for t in ratios):
        extra = round(ref_cut / per, 4)
        more = sc.run_model(lc.Protocol.from_params({**params, "model_name": res["model"]}), methods, allocations,
                            (extra,))
        res["rows"] = res["rows"] + [r for r in more["rows"] if r["method"] != "dense"]
        res["matched_target"] = extra
        for part in ("timings", "first"):
            for k_, v in more[part].items():
                res[part][k_] = res[part].get(k_, 0.0) + v
rows = [r for res in results for r in res["rows"]]
df = pd.DataFrame([{k_: v for k_, v in r.items() if k_ != "windows"} for r in rows])
size = {res["model"]: res["block_params"] for res in results}
dense = {res["model"]: res["dense"] for res in results}
df["block linears (M)"] = df["model"].map(size) / 1e6
df["PTB / dense"] = df["ppl_ptb"] / df["model"].map({m: d["ppl_ptb"] for m, d in dense.items()})
df["Wikipedia / dense"] = df["ppl_wiki"] / df["model"].map({m: d["ppl_wiki"] for m, d in dense.items()})
cols = ["model", "block linears (M)", "method", "allocation", "target", "ratio", "layers_ratio", "ppl_wiki",
        "ppl_ptb", "Wikipedia / dense", "PTB / dense", "loss"]
table = df[cols].rename(columns={"target": "target ratio", "ratio": "measured ratio",
                                 "layers_ratio": "block linears removed", "ppl_wiki": "Wikipedia ppl",
                                 "ppl_ptb": "PTB ppl", "loss": "held-out loss"})
caption = (f"Every case of the scale study: {', '.join(models)}; k = {k} calibration batches of {batch_size} x "
           f"{seq_len} C4 tokens; perplexity on the first {eval_tokens:,} tokens of a Wikipedia text and of PTB test "
           f"in {eval_seq_len}-token windows; held-out loss on {select_k} selection batches.")
tolerances = {"model": "exact", "block linears (M)": "exact", "method": "exact", "allocation": "exact",
              "target ratio": "exact", "measured ratio": "rel=1e-3", "block linears removed": "rel=1e-3",
              "Wikipedia ppl": "rel=0.05", "PTB ppl": "rel=0.05",
              "Wikipedia / dense": "rel=0.05", "PTB / dense": "rel=0.05", "held-out loss": "abs=0.02"}
figures.save_table(table, "tab_scale", output_dir, params, caption=caption, label="tab:scale", notebook=NB,
                   started=started, tolerances=tolerances)
display(Markdown(table.to_markdown(index=False, floatfmt=".4g")))

# %% [markdown]
# ## Perplexity against size, and GFWSVD's gap
# Left: each method with its better allocation (held-out selection loss), PTB perplexity relative to the dense
# model, one panel per ratio. Right: GFWSVD's log-perplexity gap to the better of SVD-LLM and KFAC-SVD (both
# texts' windows pooled; above zero GFWSVD is behind), with two paired standard errors.

# %% tags=["hide-input"]
gaps = sc.gap_rows(results, ratios)
colors = {"fwsvd": "C1", "asvd": "C7", "svd_llm": "C2", "kfac_svd": "C0", "gfwsvd": "C3", "gfwsvd_shrunk": "C4"}
fig, axes = plt.subplots(1, len(ratios) + 1, figsize=(4.2 * (len(ratios) + 1), 3.8), squeeze=False)
for ax, t in zip(axes[0], ratios):
    for m in methods:
        pts = []
        for res in results:
            r = sc.best_case(res["rows"], res["model"], m, t)
            if r is not None:
                pts.append((res["block_params"] / 1e6, r["ppl_ptb"] / res["dense"]["ppl_ptb"]))
        if pts:
            x, y = zip(*sorted(pts))
            ax.plot(x, y, marker="o", color=colors.get(m, "k"), label=m, lw=1.5 if m.startswith("gfwsvd") else 1)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_title(f"{100 * t:g} % removed")
    ax.set_xlabel("block-linear parameters (M)")
axes[0][0].set_ylabel("PTB perplexity / dense")
axes[0][0].legend(fontsize="x-small")
ax = axes[0][-1]
for j, t in enumerate(ratios):
    g = sorted((r for r in gaps if math.isclose(r["target"], t) and "gap" in r), key=lambda r: r["block_params"])
    if g:
        ax.errorbar([r["block_params"] / 1e6 * (1 + 0.03 * j) for r in g], [r["gap"] for r in g],
                    yerr=[2 * r["se"] for r in g], marker="o", capsize=3, label=f"{100 * t:g} %")
ax.axhline(0, color="k", lw=0.8, ls=":")
ax.set_xscale("log")
ax.set_xlabel("block-linear parameters (M)")
ax.set_ylabel("log ppl(GFWSVD) - log ppl(best rival)")
ax.set_title("GFWSVD's gap to its best rival")
ax.legend(fontsize="x-small")
fig.tight_layout()
figures.save_figure(fig, "fig_scale", output_dir, params, started=started, notebook=NB);

# %% [markdown]
# ## How noisy are MFF's factors?
# The split-half shrinkage intensity of each factor (0: keep the off-diagonals, 1: keep only the diagonal), by
# model and layer type.

# %% tags=["hide-input"]
lam = pd.DataFrame([{**r, "model": res["model"]} for res in results for r in res["intensities"]])
if len(lam):
    lam_table = lam.groupby(["model", "type"])[["lambda_A", "lambda_B"]].median().reset_index()
    display(Markdown(lam_table.to_markdown(index=False, floatfmt=".3f")))

# %% [markdown]
# ## Zero-shot accuracy
# The dense model and the calibrated cases named in the parameters at the largest ratio, on a fixed subset of
# each task (the same examples for every row). Beside each compressed row: its gap to GFWSVD in the task
# average, with the standard error of the paired differences over the shared examples (the rows answer most
# questions alike, so this is far smaller than the two rows' own standard errors would make it).

# %% tags=["hide-input"]
zs_rows = []
for r in rows:
    tasks = [t for t in ls.ZERO_SHOT if t in r and r.get(f"{t}_n")]
    if tasks:
        acc = np.mean([r[t] for t in tasks])
        se = math.sqrt(sum(r[f"{t}_se"] ** 2 for t in tasks)) / len(tasks)
        ref = next((g for g in rows if g["model"] == r["model"] and g["method"] == "gfwsvd"
                    and g["allocation"] == r["allocation"] and math.isclose(g["target"], r["target"])), None)
        pg = ls.paired_gap(r, ref) if ref is not None and r["method"] != "gfwsvd" else None
        zs_rows.append({"model": r["model"], "method": r["method"], "allocation": r["allocation"],
                        "target": r["target"], "mean accuracy": acc, "se": se,
                        "examples": int(sum(r[f"{t}_n"] for t in tasks)),
                        "gap to GFWSVD (paired)": "" if pg is None else f"{pg['diff']:+.3f} ± {pg['se']:.3f}",
                        "paired": pg})
zs = pd.DataFrame(zs_rows)
if len(zs):
    display(Markdown(zs.drop(columns="paired").to_markdown(index=False, floatfmt=".3f")))

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
for t in ratios:
    tr = sc.trend(gaps, t)
    verdict[f"trend_{t:g}"] = tr
    if tr.get("models", 0) < 2:
        lines.append(f"* At {100 * t:g} %: {tr.get('models', 0)} model, no trend to read.")
        continue
    how = ("shrinks" if tr["shrinks"] else "grows" if tr["grows"] else "does not change beyond two standard errors")
    lines.append(f"* At {100 * t:g} %, GFWSVD's log-perplexity gap to its best rival is {tr['gap_smallest']:+.3f} on "
                 f"{tr['smallest']} and {tr['gap_largest']:+.3f} on {tr['largest']} (change {tr['change']:+.3f} ± "
                 f"{tr['se']:.3f}; slope {tr['slope_per_decade']:+.3f} per decade of block-linear parameters): it "
                 f"{how} with size.")
# the same trend at a matched cut: per model its target whose share of block linears removed (measured, the median
# over its cases) is nearest the first model's at the largest ratio (ref_cut; kept only within a quarter of it)
cut = df[df["method"] != "dense"].groupby(["model", "target"])["layers_ratio"].median()
own = {m: sorted(t for (m_, t) in cut.index if m_ == m) for m in models}
gaps_all = sc.gap_rows(results, sorted({t for ts in own.values() for t in ts}))
matched = []
for m in models:
    near = min(own[m], key=lambda t: abs(cut[(m, t)] - ref_cut)) if own[m] else None
    if near is not None and abs(cut[(m, near)] - ref_cut) <= 0.25 * ref_cut:
        matched += [{**g, "target": -1.0, "chosen": near} for g in gaps_all
                    if g["model"] == m and math.isclose(g["target"], near) and "gap" in g]
tr = sc.trend(matched, -1.0)
unmatched = [m for m in models if own[m] and m not in {g["model"] for g in matched}]
verdict["trend_matched_cut"] = {**tr, "reference_share": float(ref_cut), "unmatched": unmatched}
if unmatched:
    lines.append(f"* No target of {', '.join(unmatched)} removes about {100 * ref_cut:.0f} % of its block linears (the "
                 "matched cut below" + ("" if match_cut else "; `match_cut` adds one") + ").")
if tr.get("models", 0) >= 2:
    how = ("shrinks" if tr["shrinks"] else "grows" if tr["grows"] else "does not change beyond two standard errors")
    picks = ", ".join(f"{g['model']} at {100 * g['chosen']:g} % of the model" for g in matched)
    lines.append(f"* At a matched cut (about {100 * ref_cut:.0f} % of the block linears removed: {picks}), GFWSVD's "
                 f"gap is {tr['gap_smallest']:+.3f} on {tr['smallest']} and {tr['gap_largest']:+.3f} on {tr['largest']} "
                 f"(change {tr['change']:+.3f} ± {tr['se']:.3f}): it {how} with size.")
eff = sc.shrinkage_effect(results, ratios)
verdict["shrinkage"] = eff
for e in eff:
    helped = ("helps" if e["shrunk_vs_plain"] < -2 * e["se"] else "hurts" if e["shrunk_vs_plain"] > 2 * e["se"]
              else "changes nothing beyond two standard errors")
    share = e["share_closed"]
    closed = ("" if not math.isfinite(share) else f"; it closes {100 * share:.0f} % of GFWSVD's gap to KFAC-SVD"
              if share >= 0 else f"; it widens GFWSVD's gap to KFAC-SVD by {-100 * share:.0f} %")
    lines.append(f"* Shrinkage on {e['model']} at {100 * e['target']:g} %: log-perplexity {e['shrunk_vs_plain']:+.3f} ± "
                 f"{e['se']:.3f} against plain GFWSVD: it {helped}{closed}.")
for t in ratios:
    rk = sc.rankings(results, t)
    verdict[f"ranking_{t:g}"] = rk
    orders = "; ".join(f"{m}: {' < '.join(o)}" for m, o in rk["order"].items())
    taus = ", ".join(f"{k_} {v:.2f}" for k_, v in rk["kendall_tau"].items())
    lines.append(f"* Order by PTB at {100 * t:g} % (calibrated_kl, best first): {orders}"
                 + (f". Kendall's tau between models: {taus}." if taus else "."))
told = [z for z in zs_rows if z["paired"] is not None]
if told:
    apart = [f"{z['method']} on {z['model']} ({z['paired']['diff']:+.3f} ± {z['paired']['se']:.3f})" for z in told
             if z["paired"]["beyond"]]
    lines.append(f"* Zero-shot ({zero_shot_limit} examples per task, the same for every row): {len(apart)} of "
                 f"{len(told)} compressed rows differ from GFWSVD's by more than two paired standard errors"
                 + (f": {', '.join(apart)}." if apart else "."))
    verdict["zero_shot_apart"] = len(apart)
share = cut  # each model's share of block linears removed at each target (above)
verdict["block_share_removed"] = {f"{m} / {t:g}": float(v) for (m, t), v in share.items()}
lines.append("* The same whole-model target is not the same cut for every model: the share of its block linears "
             "removed is " + "; ".join(f"{m} " + " / ".join(f"{100 * share[(m, t)]:.0f} %" for t in ratios
                                                               if (m, t) in share) for m in models
                                       if any((m, t) in share for t in ratios))
             + f" (at {' / '.join(f'{100 * t:g} %' for t in ratios)} of the whole model; the embeddings are the "
             "rest). Where these shares differ, a gap that moves between models moves with the depth of the cut as "
             "much as with size; the paper's Llamas keep about 4 % of their parameters in embeddings.")
sizes = sorted(size.values())
if len(sizes) > 1:
    lines.append(f"* What these sizes can tell: block linears from {sizes[0] / 1e6:.0f}M to {sizes[-1] / 1e6:.0f}M "
                 f"parameters ({sizes[-1] / sizes[0]:.1f}x), every model 4-bit-quantised before we dequantised it. "
                 f"Llama-2-7B's block linears (about 6.5B) are {6.5e9 / sizes[-1]:.0f}x the largest here: a trend over "
                 f"{len(sizes)} points this close together can say whether the gap moves with size here, not where it "
                 f"ends at 7B.")
first = {}
for res in results:
    for k_, v in res["first"].items():
        first[k_] = first.get(k_, 0.0) + v
lines.append(ls.cost_line(first, {k_: sum(res["timings"].get(k_, 0.0) for res in results) for k_ in first}))
verdict.update(models={res["model"]: {"params": res["params"], "block_params": res["block_params"],
                                      "layers": res["layers"], "dense": {k_: v for k_, v in res["dense"].items()
                                                                         if k_ != "windows"}} for res in results},
               gaps=gaps)
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "fig_scale_summary",
                         figures.provenance("fig_scale_summary", params, started=started, notebook=NB,
                                            extra={"verdict": verdict, "lines": lines}));
