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
# # Kronecker spectrum of the rearranged Fisher of every linear layer (paper Sec. 4, Fig. singular_values)
#
# **Claim (paper Sec. 4, "Rank-1 Kronecker Fisher and multi-term extensions").** On Llama-2-7B-chat,
# "for some layers the Kronecker spectrum decays slowly, so a rank-1 factor may leave a noticeable
# fraction of curvature unexplained": Fig. singular_values shows the singular values of the rearranged
# Fisher $\mathcal R(F)$ of all 224 linear layers, and of the 74 layers with $\sigma_1/\sigma_2 > 3$,
# where one Kronecker term $A\otimes B$ dominates.

# %% [markdown]
# ## Experiment
#
# For every linear layer of the embedded SmolLM2-135M (Llama role, 210 layers)
# and MiniLM-L6 (BERT role, 36 layers) we compute the top `terms` singular values of
# $\mathcal R(F) = \frac1k\sum_i G_i^\top\otimes G_i^\top$ from the $k$ calibration gradients
# (`fisherkron.kronecker_terms`, matrix-free Golub-Kahan-Lanczos), and the share of the Fisher
# one term holds,
#
# $$\frac{\sigma_1^2}{\lVert F\rVert_F^2},\qquad \lVert F\rVert_F^2=\lVert\mathcal R(F)\rVert_F^2=\frac1{k^2}\sum_{i,j}\langle G_i,G_j\rangle^2,$$
#
# the norm read exactly from the $k\times k$ Gram matrix of the gradients. $\mathcal R(F)$ is
# not of rank $\le k$: a single gradient $G=\sum_a s_a p_a q_a^\top$ gives
# $\mathcal R(gg^\top)=G^\top\otimes G^\top$ with singular values $s_a s_b$, so $k=4$ gradients
# already give hundreds of non-zero Kronecker singular values per layer; $k$ sets how well the
# Fisher is estimated, which the last table checks by recomputing some layers from fewer
# gradients. Calibration: SmolLM2 as in the rank-allocation study (C4, $k$ batches of 2 x 256
# tokens, next-token loss; same cache); MiniLM on SST-2 training sentences with the
# classification loss (its head is not fine-tuned: drawn with a fixed seed). All of it is
# `fisherkron.experiments.spectrum`; each layer's spectrum is cached on disk as soon as it is
# computed.
#
# **How to read.** Fig. `fig_singular_values`: one row per model; left, $\sigma_j/\sigma_1$
# against $j$ for every layer (log scale, colour = layer type); right, only the layers with
# $\sigma_1/\sigma_2 >$ `threshold`. Table `tab_singular_values`: per layer type, how many layers
# have that gap and how much of $F$ one term holds. SmolLM2's weights were 4-bit quantised and
# then dequantised, so its spectra are those of the quantised model.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make all`, 2 CPU cores); the paper-scale value in the comment
# (`make all PROFILE=paper`, notebooks/params/fig_singular_values.paper.yaml).
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
models = {  # model -> calibration (k batches of batch_size sequences of seq_len tokens; layers regex or None)
    "smollm2": {"k": 4, "batch_size": 2, "seq_len": 256, "layers": None},
    "minilm": {"k": 4, "batch_size": 16, "seq_len": 128, "layers": None},
}  # paper: {"meta-llama/Llama-2-7b-chat-hf": {"k": 75, "batch_size": 128, "seq_len": 2048, "layers": None}}
calib_docs = 500  # C4 documents the decoder's windows come from; paper: 500
data_profile = "default"  # "paper": FineWeb and the hub's SST-2; paper: "paper"
terms = 10  # singular values per layer; paper: 10
tol = 0.001  # Lanczos residual of each triplet relative to sigma_1; paper: 0.001
threshold = 3.0  # the paper's gap sigma_1 / sigma_2; paper: 3.0
k_check = [1, 2]  # fewer gradients on a few layers, to see how the spectrum moves with k; paper: [8, 32]
k_check_layers = {  # model -> regex of the layers recomputed with k_check gradients
    "smollm2": "model\\.layers\\.(0|29)\\.self_attn\\.\\w+",
    "minilm": "bert\\.encoder\\.layer\\.0\\..*",
}  # paper: {"meta-llama/Llama-2-7b-chat-hf": "model\\.layers\\.(0|31)\\.self_attn\\.\\w+"}

# %% tags=["hide-input"]
import re
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import transformers
from IPython.display import Markdown, display

from fisherkron.experiments import spectrum
from fisherkron.repro import figures

transformers.logging.set_verbosity_error()  # no load report (MiniLM's classification head is new)
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
params = dict(models=models, calib_docs=calib_docs, data_profile=data_profile, terms=terms, tol=tol,
              threshold=threshold, k_check=k_check, k_check_layers=k_check_layers, profile=profile)
stats, rows = {}, []
for name, cal in models.items():
    t = time.perf_counter()
    _, _, st = spectrum.calibrate(name, k=cal["k"], batch_size=cal["batch_size"], seq_len=cal["seq_len"],
                                  calib_docs=calib_docs, layers=cal["layers"], data_profile=data_profile,
                                  progress=True)
    stats[name] = st
    recs = spectrum.model_spectra(st, terms, tol=tol, progress=True)
    rows += [dict(r, model=name) for r in recs]
    print(f"{name}: {len(recs)} layers, k = {st.k} ({'cached calibration' if st.from_cache else 'calibrated'}); "
          f"{time.perf_counter() - t:.0f} s")
df = pd.DataFrame(rows)
df["gap"] = df["ratio_12"] > threshold
sig = np.array(df["sigma"].tolist())  # (layers, terms)
norm = sig / sig[:, :1]  # sigma_j / sigma_1
df[["layer", "n", "m", "k", "ratio_12", "share_1", "share_top", "matvecs", "converged"]].describe()

# %% [markdown]
# ## The spectra

# %% tags=["hide-input"]
mnames = list(models)
fig, axes = plt.subplots(len(mnames), 2, figsize=(12, 4.2 * len(mnames)), squeeze=False, sharey="row")
j = np.arange(1, terms + 1)
for row, name in zip(axes, mnames):
    sel = (df["model"] == name).to_numpy()
    types = list(dict.fromkeys(df.loc[sel, "type"]))
    colour = {t: plt.cm.tab10(i % 10) for i, t in enumerate(types)}
    for ax, only_gap in zip(row, (False, True)):
        idx = np.flatnonzero(sel & (df["gap"].to_numpy() if only_gap else True))
        for i in idx:
            ax.semilogy(j, norm[i], color=colour[df["type"].iloc[i]], alpha=0.55, lw=1)
        for t in types:  # legend entries: one per type present in this panel
            if any(df["type"].iloc[i] == t for i in idx):
                ax.plot([], [], color=colour[t], label=t)
        what = "all layers" if not only_gap else f"layers with $\\sigma_1/\\sigma_2 > {threshold:g}$"
        ax.set_title(f"{name}: {what} ({len(idx)} of {int(sel.sum())})")
        ax.set_xlabel("index $j$")
        ax.set_ylabel("$\\sigma_j / \\sigma_1$")
        ax.set_xticks(j)
        ax.grid(alpha=0.3, which="both")
        if len(idx):
            ax.legend(fontsize="x-small", ncol=2)
        else:
            ax.text(0.5, 0.5, "no layer", transform=ax.transAxes, ha="center")
fig.suptitle("Singular values of the rearranged Fisher $\\mathcal{R}(F)$ per linear layer "
             f"(k = {', '.join(f'{n}: {stats[n].k}' for n in mnames)}; SmolLM2 weights 4-bit quantised, dequantised)")
fig.tight_layout()
figures.save_figure(fig, "fig_singular_values", output_dir, params, started=started,
                    notebook="notebooks/fig_singular_values.py");

# %% [markdown]
# ## Per layer type: the gap and the share of one term

# %% tags=["hide-input"]
summary = pd.concat([pd.DataFrame(spectrum.summary_by_type(df[df.model == n].to_dict("records"), threshold))
                     .assign(model=n) for n in mnames], ignore_index=True)
summary = summary[["model", "type", "layers", "gap_layers", "median_ratio_12", "median_share_1", "min_share_1",
                   "max_share_1", "median_share_top"]]
figures.save_table(summary, "tab_singular_values", output_dir, params, started=started,
                   notebook="notebooks/fig_singular_values.py", floatfmt=".3g", label="tab:singular_values",
                   caption=f"Kronecker spectrum per layer type: layers with sigma_1/sigma_2 > {threshold:g} "
                           f"(gap_layers) and the Fisher share sigma_1^2/||F||^2 one term holds; share_top: "
                           f"the top {terms} terms. SmolLM2: 4-bit-quantised weights, dequantised; MiniLM: "
                           f"SST-2 loss through an untrained (seeded) classification head.")
per_layer = df[["model", "layer", "type", "n", "m", "k", "ratio_12", "share_1", "share_top", "matvecs",
                "converged", "residual"]].copy()
for i in range(terms):
    per_layer[f"s{i + 1}/s1"] = norm[:, i]
figures.save_table(per_layer, "tab_singular_values_layers", output_dir, params, started=started,
                   notebook="notebooks/fig_singular_values.py", floatfmt=".4g")
display(Markdown(summary.to_markdown(index=False, floatfmt=".3g")))

# %% [markdown]
# ## Does the spectrum move with the number of gradients?
# The same layers recomputed from the first $k' < k$ gradients.

# %%
krows = []
for name in mnames:
    pattern = k_check_layers.get(name)
    if not pattern:
        continue
    pick = [n for n in stats[name].layers if re.fullmatch(pattern, n)]
    for kk in sorted({*[x for x in k_check if x < stats[name].k], stats[name].k}):
        for r in spectrum.model_spectra(stats[name], terms, tol=tol, layers=pick, k=kk):
            krows.append({"model": name, "layer": r["layer"], "k": kk, "ratio_12": r["ratio_12"],
                          "share_1": r["share_1"], "share_top": r["share_top"]})
kdf = pd.DataFrame(krows, columns=["model", "layer", "k", "ratio_12", "share_1", "share_top"])
figures.save_table(kdf, "tab_singular_values_k", output_dir, params, started=started,
                   notebook="notebooks/fig_singular_values.py", floatfmt=".3g")
if len(kdf):
    display(kdf.pivot_table(index=["model", "layer"], columns="k", values=["ratio_12", "share_1"]))

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
for name in mnames:
    d = df[df.model == name]
    gap, total = int(d["gap"].sum()), len(d)
    slow = d["share_1"] < 0.5
    tail = np.median(norm[(df.model == name).to_numpy(), terms - 1])
    verdict[name] = {"layers": total, "gap_layers": gap, "gap_fraction": gap / total,
                     "median_share_1": float(d["share_1"].median()), "layers_share_1_below_half": int(slow.sum()),
                     "median_sigma_last_over_sigma_1": float(tail), "k": int(stats[name].k),
                     "all_converged": bool(d["converged"].all())}
    lines.append(f"* **{name}** (k = {stats[name].k}): {gap} of {total} layers ({gap / total:.0%}) have "
                 f"sigma_1/sigma_2 > {threshold:g} (paper, Llama-2-7B-chat: 74 of 224 = 33%). One Kronecker term "
                 f"holds a median {d['share_1'].median():.1%} of ||F||^2 (range {d['share_1'].min():.1%} to "
                 f"{d['share_1'].max():.0%}); in {int(slow.sum())} layers it holds less than half. Median "
                 f"sigma_{terms}/sigma_1 = {tail:.2f}: the spectrum "
                 f"{'decays slowly (above 0.1)' if tail > 0.1 else 'decays fast (below 0.1)'} past the first term.")
    best = d.groupby("type")["ratio_12"].median().sort_values(ascending=False)
    lines.append(f"  Largest median gap: {best.index[0]} ({best.iloc[0]:.1f}); smallest: {best.index[-1]} "
                 f"({best.iloc[-1]:.1f}).")
if len(kdf):
    for name in kdf["model"].unique():
        moved = kdf[kdf.model == name].pivot_table(index="layer", columns="k", values=["ratio_12", "share_1"])
        ks = sorted(kdf.loc[kdf.model == name, "k"].unique())
        if len(ks) < 2:
            continue
        f_gap = moved["ratio_12"][ks[0]] / moved["ratio_12"][ks[-1]]
        f_share = moved["share_1"][ks[0]] / moved["share_1"][ks[-1]]
        spread = float(np.exp(np.abs(np.log(np.concatenate([f_gap, f_share]))).max()))
        verdict[name]["k_check_max_factor"] = spread
        lines.append(f"* {name}, k check ({len(moved)} layers, k = {ks[0]} against {ks[-1]}): sigma_1/sigma_2 "
                     f"changes by a factor {f_gap.min():.2f} to {f_gap.max():.2f}, the share of one term by "
                     f"{f_share.min():.2f} to {f_share.max():.2f}: the spectrum "
                     f"{'is stable in k (within 25%)' if spread <= 1.25 else 'still moves with k'}, so these are "
                     f"spectra of a {ks[-1]}-gradient empirical Fisher"
                     f"{'' if spread <= 1.25 else ', not of the Fisher itself'}.")
if not df["converged"].all():
    lines.append(f"* {int((~df['converged']).sum())} layers stopped at the Lanczos budget before tol = {tol:g}.")
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "fig_singular_values_summary",
                         figures.provenance("fig_singular_values_summary", params, started=started,
                                            notebook="notebooks/fig_singular_values.py",
                                            extra={"verdict": verdict, "lines": lines}));
