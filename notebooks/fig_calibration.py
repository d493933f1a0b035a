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
# # Calibration at scale: does MFF's Fisher improve with more gradients, and what does it cost?
#
# **Claim (paper Secs. 4-6; this study goes beyond the paper).** MFF finds the *best* Kronecker
# approximation of the empirical Fisher (Algorithm 1), where K-FAC's `E[x xᵀ] ⊗ E[δ δᵀ]` is a heuristic;
# the paper calibrates on 75 batches of 128 FineWeb samples. The question here: does GFWSVD, with MFF's
# factors, overtake the same transform with K-FAC factors (KFAC-SVD) and close the gap to SVD-LLM as its
# gradients grow in number, at a cost one small machine can pay?

# %% [markdown]
# ## Experiment
#
# The rank-allocation study calibrates on 4 batches of 2 × 256 tokens, where K-FAC's factors beat
# MFF's; this study grows `k`. SmolLM2-135M (4-bit-quantised weights, dequantised), all 210 linear
# layers of its blocks. Calibration: `k` batches of 2 × 256 tokens from the first 500 C4 documents,
# gradients stored in bfloat16 (the authors' choice). Every method's ranks come from the
# `fisher` allocation (each method's own Theorem-1 error curves, no model evaluation), so the
# strategy is the same for every `k`. Evaluation: PTB test and Wikipedia, their first 4,096
# tokens each.
# * **Cost** of each setting, measured in a fresh process: collection (the gradients plus the
#   K-FAC and `X Xᵀ` statistics the three methods read), MFF's factors of every layer (K-FAC
#   warm start), GFWSVD compression; seconds, tokens/s, disk, peak resident memory (memory-mapped
#   gradient files count towards it). The target: k = 32, factors and GFWSVD of all 210
#   layers in at most 15 minutes on 2 cores, 12 GB RAM, 8 GB disk; it is also timed on GFWSVD's
#   own default path (gradients only, MFF from the identity). `k` = 64 is measured for its
#   collection cost only.
# * **Warm start:** MFF from K-FAC against MFF from the identity on the same layers, and what
#   collecting K-FAC's statistics costs.
# * **16-bit gradients:** MFF's `A ⊗ B` from bfloat16/float16 gradients against float32.
# * **Granularity** with the same calibration tokens: one gradient per batch (the paper's),
#   per sequence, per token (`core.operators.TokenFisher`).
#
# Everything is `fisherkron.experiments.calibration_study`; this notebook loops and plots. Each
# record is cached in `data/cache/studies/` as soon as it is measured, so the notebook can be
# stopped and rerun; it collects every calibration it uses itself (its time from a cold cache:
# `make help`; a run that reads its records from the cache takes minutes).

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make fig_calibration`); the paper-scale value in the comment.
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-2-7b-chat-hf"
batch_size = 2  # sequences per calibration batch; paper: 128
seq_len = 256  # tokens per sequence; paper: 2048
calib_docs = 500  # paper: 500
layers = None  # regex of the layers (None: every linear layer of the blocks); paper: None
eval_tokens = 4096  # tokens of each evaluation text; paper: 0 (all)
eval_seq_len = 512  # paper: 2048
ks = [4, 16, 32]  # calibration sizes of the quality grid; paper: [16, 32, 75]
cost_only_ks = [64]  # sizes measured for their collection cost only (temporary folder); paper: []
grad_dtype = "bfloat16"  # paper: "bfloat16"
methods = ["gfwsvd", "kfac_svd", "svd_llm"]  # paper: same
ratios = [0.10, 0.20]  # whole-model compression ratios; paper: [0.1, 0.2, 0.3, 0.4, 0.5]
granularities = ["sequence", "token"]  # besides "batch"; paper: ["sequence"]
granularity_k = 4  # the batches whose tokens the granularities share; paper: 8
end2end_k = 32  # the setting of the cost target; paper: 75
end2end_ratio = 0.2  # GFWSVD ratio of the end-to-end timing; paper: 0.2
warm_layers = r"model\.layers\.(0|15|29)\..*"  # layers of the warm-start comparison; paper: r"model\.layers\.(0|15|31)\..*"
encoding_k = 16  # batches of the 16-bit check; paper: 16
encoding_layers = r"model\.layers\.(0|29)\..*"  # paper: r"model\.layers\.(0|31)\..*"
mff_tol = 1e-4  # paper: 1e-4
mff_dtype = "float64"  # MFF in the quality grid (same ranks on any CPU; the cost table times float32); paper: "float64"
isolate_costs = True  # each cost measurement in a fresh process (its own peak memory); smoke: False
target_minutes = 15.0  # cost target at end2end_k
target_ram_gb = 12.0
target_disk_gb = 8.0
idle_share = 0.1  # a timing counts as taken on idle cores when other processes used less than this share of them

# %% tags=["hide-input"]
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.env import REPO_ROOT
from fisherkron.experiments import calibration_study as cs
from fisherkron.repro import figures

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "batch_size", "seq_len", "calib_docs", "layers", "eval_tokens",
                    "eval_seq_len", "ks", "cost_only_ks", "grad_dtype", "methods", "ratios", "granularities",
                    "granularity_k", "end2end_k", "end2end_ratio", "warm_layers", "encoding_k", "encoding_layers",
                    "mff_tol", "mff_dtype", "isolate_costs")}
study = cs.prepare(model_name, batch_size=batch_size, seq_len=seq_len, calib_docs=calib_docs, layers=layers,
                   eval_tokens=eval_tokens or 10**9, eval_seq_len=eval_seq_len, mff_tol=mff_tol, isolate=isolate_costs,
                   mff_dtype=mff_dtype)
where = Path(study.results_path).resolve()  # shown relative to the repository
print(f"uncompressed: PTB {study.base['ppl_ptb']:.2f}, Wikipedia {study.base['ppl_wiki']:.2f}; records in "
      f"{where.relative_to(REPO_ROOT) if where.is_relative_to(REPO_ROOT) else where.name}")


def log(msg):
    print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)


# %% [markdown]
# ## What 16-bit gradients do to MFF's factors
# The same `encoding_k` batches, gradients of the `encoding_layers` stored in float32, bfloat16
# and float16 (with a per-gradient scale); MFF from the identity in each. The error is
# `‖A⊗B − A₀⊗B₀‖_F / ‖A₀⊗B₀‖_F` against float32, next to MFF's own tolerance.

# %%
enc = cs.encoding_error(study, encoding_k, encoding_layers)
enc_df = pd.DataFrame(enc["rows"])
enc_summary = enc_df.groupby("encoding")["rel_error"].agg(["median", "max"]).reset_index()
display(Markdown(enc_summary.to_markdown(index=False, floatfmt=".2e")))
log("16-bit check done")

# %% [markdown]
# ## Cost of each setting (fresh processes)
# The measurements log one line per setting (collapsed); the table follows.

# %% tags=["hide-input", "hide-output"]
cost = {}
for k in ks:
    cost[cs.setting_name(k, "batch", grad_dtype)] = cs.measure(
        study, k, grad_dtype=grad_dtype, methods=methods,
        compress_ratio=end2end_ratio if k == end2end_k else None)
    log(f"cost k = {k}")
for g in granularities:
    dt = "float32" if g == "token" else grad_dtype
    cost[cs.setting_name(granularity_k, g, dt)] = cs.measure(study, granularity_k, granularity=g, grad_dtype=dt,
                                                             methods=methods)
    log(f"cost {g}")
for k in cost_only_ks:
    cost[cs.setting_name(k, "batch", grad_dtype) + " (collection only)"] = cs.measure(
        study, k, grad_dtype=grad_dtype, methods=methods, mff=False, keep=False)
    log(f"cost k = {k} (collection only)")
# The warm-start comparison: the same layers from the identity, on the end-to-end setting's gradients;
# and the collection with and without K-FAC's statistics (temporary folders).
warm = cs.measure(study, end2end_k, grad_dtype=grad_dtype, methods=methods, mff_layers=warm_layers,
                  inits=("identity",), tag="warm-start")
no_kfac = cs.measure(study, granularity_k, grad_dtype=grad_dtype, stats=("grads",), mff=False, keep=False)
# GFWSVD's own default: only the gradients are collected and MFF starts from the identity (temporary folder).
e2e_default = cs.measure(study, end2end_k, grad_dtype=grad_dtype, methods=("gfwsvd",), inits=("identity",),
                         compress_ratio=end2end_ratio, keep=False)
cost[cs.setting_name(end2end_k, "batch", grad_dtype) + " (GFWSVD only, identity start)"] = e2e_default
with_kfac = cs.measure(study, granularity_k, grad_dtype=grad_dtype, stats=("grads", "kfac"), mff=False, keep=False)
log("warm start done")

# %% tags=["hide-input"]
rows = []
for name, r in cost.items():
    m = r.get("mff_kfac") or r.get("mff_identity") or {}
    rows.append({"setting": name, "gradients": r["gradients"], "tokens": r["tokens"],
                 "collect_s": r["collect_seconds"], "tokens_per_s": r["tokens_per_s"],
                 "mff_s": m.get("seconds"), "matvecs": m.get("matvecs"), "mff_gflops_per_s": m.get("gflops_per_s"),
                 "compress_s": r.get("compress_seconds"),
                 "total_min": (r["collect_seconds"] + m.get("seconds", 0) + r.get("compress_seconds", 0)) / 60,
                 "disk_gb": r["disk_gb"], "peak_rss_gb": r["peak_gb"], "others_load": r.get("others_cpu_share"),
                 "measured_now": bool(r["collected_now"] and not r.get("resumed", False)
                                      and m.get("computed_now", 0) == m.get("layers", 0))})
cost_df = pd.DataFrame(rows)
figures.save_table(cost_df, "tab_calibration_cost", output_dir, params, started=started,
                   notebook="notebooks/fig_calibration.py", floatfmt=".4g", label="tab:calibration_cost",
                   caption=f"{model_name}: cost of calibration settings on {cost[next(iter(cost))]['threads']} "
                           f"threads (collection of the gradients, K-FAC and X X^T statistics unless the setting "
                           f"says otherwise; MFF of every layer; GFWSVD at {end2end_ratio:.0%} where timed; "
                           f"others_load: the share of the cores other processes used meanwhile, 0 = idle)")
display(Markdown(cost_df.to_markdown(index=False, floatfmt=".4g")))

# %% [markdown]
# ## Quality against `k` and granularity
# Each case compresses a copy of the model and is cached under the calibration's key; the
# weighted SVDs of a (calibration, method) pair are shared by its ratios. One log line per case
# (collapsed); the table follows.

# %% tags=["hide-output"]
settings = [(k, "batch", grad_dtype) for k in ks] + [
    (granularity_k, g, "float32" if g == "token" else grad_dtype) for g in granularities]
qrows = []
for k, g, dt in settings:
    stats = cs.stats_of(study, k, g, dt, methods=methods)
    for method in (methods if g == "batch" else ["gfwsvd"]):  # the other methods see the same tokens
        for ratio in ratios:
            row = cs.run_case(study, stats, method, ratio, k=k, setting=cs.setting_name(k, g, dt))
            qrows.append(row)
            log(f"k = {k:3d} {g:8s} {method:9s} {100 * ratio:g} %: PTB {row['ppl_ptb']:10.1f} wiki {row['ppl_wiki']:10.1f}")
    del stats

# %%
q = pd.DataFrame(qrows)
q["ptb_x_dense"] = q["ppl_ptb"] / study.base["ppl_ptb"]
table = q[["setting", "k", "granularity", "gradients", "method", "target_ratio", "ratio", "ppl_ptb", "ppl_wiki",
           "ptb_x_dense", "dense_layers", "compress_seconds"]]
figures.save_table(table, "tab_calibration", output_dir, params, started=started,
                   notebook="notebooks/fig_calibration.py", floatfmt=".4g", label="tab:calibration",
                   caption=f"{model_name}: perplexity against calibration size and granularity, fisher allocation, "
                           f"MFF in {mff_dtype} (dense PTB {study.base['ppl_ptb']:.2f}, Wikipedia {study.base['ppl_wiki']:.2f})")
display(Markdown(table.to_markdown(index=False, floatfmt=".4g")))

# %% [markdown]
# ## Fig. calibration: PTB perplexity against `k`, and the cost of each setting

# %% tags=["hide-input"]
colors = {"gfwsvd": "tab:blue", "kfac_svd": "tab:green", "svd_llm": "tab:red"}
fig, axes = plt.subplots(1, len(ratios) + 1, figsize=(5 * (len(ratios) + 1), 4.3))
batch = q[q.granularity == "batch"]
for ax, ratio in zip(axes, ratios):
    for method in methods:
        d = batch[(batch.method == method) & (np.isclose(batch.target_ratio, ratio))].sort_values("k")
        ax.plot(d["k"], d["ppl_ptb"], marker="o", color=colors.get(method), label=method)
    for g, mk in zip(granularities, ("s", "^", "v")):
        d = q[(q.granularity == g) & np.isclose(q.target_ratio, ratio)]
        ax.scatter(d["k"], d["ppl_ptb"], marker=mk, s=60, facecolors="none", edgecolors=colors["gfwsvd"],
                   label=f"gfwsvd, per {g}")
    ax.axhline(study.base["ppl_ptb"], color="k", ls="--", lw=1, label="uncompressed")
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("calibration batches k (2 × 256 tokens each)")
    ax.set_title(f"{100 * ratio:g} % of the parameters removed")
    ax.grid(alpha=0.3, which="both")
axes[0].set_ylabel("PTB perplexity (log)")
axes[0].legend(fontsize="x-small")
ax = axes[-1]
c = cost_df[cost_df["mff_s"].notna()]
x = np.arange(len(c))
bottom = np.zeros(len(c))
for col, label, color in (("collect_s", "collection", "tab:gray"), ("mff_s", "MFF", "tab:blue"),
                          ("compress_s", "GFWSVD compression", "tab:orange")):
    v = c[col].fillna(0).to_numpy() / 60
    ax.bar(x, v, bottom=bottom, color=color, label=label)
    bottom += v
ax.axhline(target_minutes, color="tab:red", ls=":", label=f"target ({target_minutes:g} min at k = {end2end_k})")
shared = [o is not None and o >= idle_share for o in c["others_load"]]
ax.set_xticks(x, [s.replace(f"-{grad_dtype}", "").replace("-float32", "").replace(" (GFWSVD only, identity start)",
                                                                                   "\nGFWSVD only")
                  + (" *" if sh else "") for s, sh in zip(c["setting"], shared)], rotation=30, ha="right",
              fontsize="small")
if any(shared):
    ax.text(0.01, 0.99, f"* cores shared with other work (≥ {idle_share:.0%})", transform=ax.transAxes,
            va="top", fontsize="x-small")
ax.set_ylabel("minutes on this machine")
ax.set_title("cost per setting")
ax.legend(fontsize="x-small")
fig.suptitle(f"{model_name}: calibration size and granularity, fisher allocation (dense PTB "
             f"{study.base['ppl_ptb']:.1f})")
fig.tight_layout()
figures.save_figure(fig, "fig_calibration", output_dir, params, started=started, notebook="notebooks/fig_calibration.py");

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
kmax = max(ks)


def ppl(method, k, ratio, g="batch"):
    d = q[(q.method == method) & (q.k == k) & (q.granularity == g) & np.isclose(q.target_ratio, ratio)]
    return float(d["ppl_ptb"].iloc[0]) if len(d) else float("nan")


for ratio in ratios:
    g_small, g_big = ppl("gfwsvd", min(ks), ratio), ppl("gfwsvd", kmax, ratio)
    kf_big, sl_small, sl_big = ppl("kfac_svd", kmax, ratio), ppl("svd_llm", min(ks), ratio), ppl("svd_llm", kmax, ratio)
    overtakes = g_big < kf_big
    gap_small, gap_big = g_small / sl_small, g_big / sl_big
    verdict[f"{ratio:.2f}"] = {"gfwsvd_overtakes_kfac_at_kmax": bool(overtakes), "gap_to_svd_llm_kmin": gap_small,
                               "gap_to_svd_llm_kmax": gap_big}
    lines.append(f"* **{100 * ratio:g} %:** GFWSVD PTB {g_small:.0f} at k = {min(ks)} → {g_big:.0f} at k = {kmax} "
                 f"({g_small / g_big:.2f}x better); KFAC-SVD {ppl('kfac_svd', min(ks), ratio):.0f} → {kf_big:.0f}; "
                 f"SVD-LLM {sl_small:.0f} → {sl_big:.0f}. MFF's factors "
                 f"{'**overtake**' if overtakes else '**do not overtake**'} K-FAC's at k = {kmax}. The gap to "
                 f"SVD-LLM goes from {gap_small:.2f}x to {gap_big:.2f}x: it "
                 f"{'closes' if gap_big < 1 else ('narrows' if gap_big < gap_small else 'does not narrow')}.")
for ratio in ratios:
    cand = {"batch": ppl("gfwsvd", granularity_k, ratio)}
    cand.update({g: ppl("gfwsvd", granularity_k, ratio, g) for g in granularities})
    best = min(cand, key=cand.get)
    verdict[f"granularity_{ratio:.2f}"] = {"ppl": cand, "best": best}
    lines.append(f"* **Granularity at {100 * ratio:g} %** (the tokens of k = {granularity_k} batches): "
                 + ", ".join(f"per {g} {v:.0f}" for g, v in cand.items()) + f"; best: per {best}.")
e2e = cost[cs.setting_name(end2end_k, "batch", grad_dtype)]
for label, r in (("all three methods' statistics, MFF from K-FAC", e2e),
                 ("GFWSVD's default: gradients only, MFF from the identity", e2e_default)):
    m = r.get("mff_kfac") or r.get("mff_identity")
    total_min = (r["collect_seconds"] + m["seconds"] + r.get("compress_seconds", 0)) / 60
    met = {"time": total_min <= target_minutes, "ram": r["peak_gb"] <= target_ram_gb,
           "disk": r["disk_gb"] <= target_disk_gb}
    others = r.get("others_cpu_share")
    cores = ("other load not recorded" if others is None else
             "cores otherwise idle" if others < idle_share else
             f"**cores shared**: other processes used {others:.0%} of them, so the time is an upper bound")
    verdict.setdefault("end2end", []).append({"setting": label, "minutes": total_min, "peak_gb": r["peak_gb"],
                                              "disk_gb": r["disk_gb"], "met": met, "others_cpu_share": others,
                                              "measured_now": bool(r["collected_now"] and not r.get("resumed"))})
    lines.append(f"* **Target at k = {end2end_k}, {label}** ({r['threads']} threads, {cores}): collection "
                 f"{r['collect_seconds'] / 60:.1f} min + MFF {m['seconds'] / 60:.1f} min "
                 f"({m['gflops_per_s']:.0f} GFLOP/s) + GFWSVD {r.get('compress_seconds', 0) / 60:.1f} min "
                 f"= **{total_min:.1f} min** (target {target_minutes:g}: {'met' if met['time'] else 'missed'}); "
                 f"peak RSS {r['peak_gb']:.1f} GB ({'met' if met['ram'] else 'missed'}; memory-mapped files count); "
                 f"disk {r['disk_gb']:.1f} GB ({'met' if met['disk'] else 'missed'}).")
pl = e2e["mff_kfac"]["per_layer"]
kfac_sub = sum(pl[n]["seconds"] for n in warm["mff_identity"]["per_layer"])
ident_sub = warm["mff_identity"]["seconds"]
mv_k = sum(pl[n]["matvecs"] for n in warm["mff_identity"]["per_layer"])
mv_i = warm["mff_identity"]["matvecs"]
extra_per_batch = (with_kfac["collect_seconds"] - no_kfac["collect_seconds"]) / granularity_k
saved = (ident_sub - kfac_sub) * e2e["mff_kfac"]["seconds"] / max(kfac_sub, 1e-9)
paid = extra_per_batch * end2end_k
pays = saved > paid
verdict["warm_start"] = {"layers": warm["mff_identity"]["layers"], "matvecs_kfac": mv_k, "matvecs_identity": mv_i,
                         "seconds_kfac": kfac_sub, "seconds_identity": ident_sub,
                         "kfac_collection_seconds_per_batch": extra_per_batch,
                         "saved_seconds_extrapolated": saved, "paid_seconds": paid, "pays": bool(pays)}
lines.append(f"* **K-FAC warm start** ({warm['mff_identity']['layers']} layers at k = {end2end_k}): {mv_k} products "
             f"in {kfac_sub:.0f} s from K-FAC against {mv_i} in {ident_sub:.0f} s from the identity; extrapolated "
             f"to all layers it saves {saved:.0f} s, and collecting K-FAC's statistics costs "
             f"{extra_per_batch:.2f} s per batch ({paid:.0f} s at k = {end2end_k}): the warm start "
             f"{'pays' if pays else 'does not pay'} for itself. GFWSVD's default "
             f"(`collect_calibration(methods=('gfwsvd',))` collects no K-FAC statistics, so MFF starts from the "
             f"identity) is therefore {'not ' if pays else ''}the faster choice.")
lines.append(f"* **16-bit gradients** (k = {encoding_k}, {enc_df['layer'].nunique()} layers): "
             + "; ".join(f"{r.encoding} error median {r['median']:.1e}, max {r['max']:.1e}"
                         for _, r in enc_summary.iterrows()) + f" (MFF's tol = {mff_tol:g}).")
for name, r in cost.items():
    if name.endswith("(collection only)"):
        lines.append(f"* **{name}:** {r['collect_seconds'] / 60:.1f} min, {r['tokens_per_s']:.0f} tokens/s, "
                     f"{r['disk_gb']:.1f} GB on disk, peak RSS {r['peak_gb']:.1f} GB.")
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "fig_calibration_summary",
                         figures.provenance("fig_calibration_summary", params, started=started,
                                            notebook="notebooks/fig_calibration.py",
                                            extra={"verdict": verdict, "lines": lines, "encoding": enc["rows"]}))
log("done")
