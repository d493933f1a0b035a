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
# # FLOPs and inference speed of compressed models (paper Sec. 6.3 and App. F; Tabs. flops_comparison, throughput_fwsvd, throughput_forward)
#
# **Claim (paper Sec. 6.3, App. F).** Factorising $W$ ($n\times m$) into $W_2W_1$ of rank $r$ cuts a
# layer's cost from $\mathcal O(nm)$ to $\mathcal O(r(n+m))$ (Tab. flops_comparison, Llama-2-7B-chat), and
# it shows in wall time: FWSVD-compressed Llama-2-7B-chat runs at 1.07x the tokens/s at 10 % and 1.34x at
# 50 % (Tab. throughput_fwsvd: A100, batch 1, 1,024 tokens), and GFWSVD's latency per token at batch 16
# and 64 falls by 1.49x and 1.59x at 50 % (Tab. throughput_forward).

# %% [markdown]
# ## Experiment
#
# The embedded SmolLM2-135M (Llama role) is compressed by `method` (GFWSVD, with
# the rank-allocation study's cached calibration) at the whole-model ratios `ratios`, with one
# per-layer ratio for every linear layer of the blocks (**uniform ranks**, not the paper's
# sensitivity allocation: speed depends only on the ranks, and uniform ranks are the same for
# every method). For each model:
# * FLOPs of one forward pass over `flop_seq_len` tokens (2 FLOPs per multiply-add of every
#   matrix product: linear layers, LM head, attention's $QK^\top$ and $PV$), analytic
#   (`fisherkron.hf.speed.forward_flops`) and counted by `torch.utils.flop_counter.FlopCounterMode`
#   on a shape-only (`meta`) copy; the same for Llama-2-7B from its config alone, beside the
#   paper's numbers;
# * measured prefill throughput: tokens/s of a forward pass at batch `forward_batch` over
#   `forward_seq_len` tokens (Tab. throughput_fwsvd's setting);
# * measured latency per generated token: one decoding step at batch 16 and 64, each sequence
#   attending to `decode_context` cached tokens (Tab. throughput_forward; a shorter context than
#   the paper's 1,024 to fit 2 cores, stated in the table). The paper does not define its
#   "latency per token"; its values grow with the batch (3.2 ms at 16, 4.7 ms at 64), as the
#   time of a decoding step does and the time per token of a forward pass would not, so we time
#   decoding steps;
# * every distinct factorised layer shape timed alone (`fisherkron.hf.speed.layer_speedup`), to
#   find the layers the factorisation slows down; and the models at `keep_dense_ratios` compressed
#   again with `fisherkron.compress(..., min_speedup=1.0)`, which keeps those layers dense (and so
#   removes fewer parameters than the ratio asked for: the achieved ratio is in the table).
#
# Medians of `*_repeats` runs after `warmup` runs, on `device` in `dtype`; the machine is in the
# provenance records, and a CPU timing shared with other processes is noisy.
#
# **How to read.** Fig. `fig_throughput`: left, measured speedup against the FLOP speedup (dense
# FLOPs / compressed FLOPs; the diagonal is "speed follows FLOPs", the dashed line `target` of
# it); right, the speedup of each factorised layer shape against its FLOP speedup. The tables
# carry the numbers and the paper's beside ours.

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make all`, 2 CPU cores); the paper-scale value in the comment
# (`make all PROFILE=paper`, notebooks/params/tab_throughput.paper.yaml).
output_dir = "figures"  # paper: "figures/paper"
profile = "default"
model_name = "smollm2"  # paper: "meta-llama/Llama-2-7b-chat-hf"
method = "gfwsvd"  # paper: "svd" (the same ranks; factor values do not change speed, and svd needs no calibration)
ratios = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]  # whole-model ratios, uniform ranks; paper: [0.0, 0.1, 0.15, 0.2, 0.4, 0.5]
layers = None  # regex of the layers compressed (None: every linear layer of the blocks); paper: None
k = 4  # calibration batches of GFWSVD (the rank-allocation study's); paper: 75
batch_size = 2  # paper: 128
seq_len = 256  # paper: 2048
calib_docs = 500  # paper: 500
data_profile = "default"  # paper: "paper"
mff_tol = 0.0001  # MFF's target error (the rank-allocation study's, so its cached factors are reused); paper: 0.0001
device = "cpu"  # paper: "cuda"
dtype = "float32"  # paper: "float16"
flop_seq_len = 1024  # tokens of the counted forward pass (batch 1); paper: 1024
forward_batch = 1  # paper: 1
forward_seq_len = 1024  # paper: 1024
forward_repeats = 3  # paper: 100
decode_batches = [16, 64]  # paper: [16, 64]
decode_context = 256  # cached tokens each decoding step attends to; paper: 1024
decode_repeats = 10  # paper: 100
warmup = 1  # untimed runs before each measurement; paper: 10
layer_tokens = [1024, 16, 64]  # rows of the layer timings (forward_batch x forward_seq_len, the decode batches); paper: same
layer_repeats = 7  # paper: 25
keep_dense_ratios = [0.1, 0.5]  # ratios also compressed with min_speedup; paper: [0.1, 0.5]
min_speedup = 1.0  # keep a layer dense unless factorising it speeds it up at least this much; paper: 1.0
extra_flops_model = "meta-llama/Llama-2-7b-chat-hf"  # FLOPs from its config (no weights); paper: None (it is the model)
extra_flops_ratios = [0.0, 0.1, 0.15, 0.2, 0.4, 0.5]  # the ratios of the paper's table; paper: same
target = 0.8  # our target: the batch-1 speedup at the largest ratio is at least target x its FLOP speedup

# %% tags=["hide-input"]
import copy
import gc
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import transformers
from IPython.display import Markdown, display

import fisherkron as fk
from fisherkron.repro import figures
from fisherkron.experiments import throughput as tp
from fisherkron.hf.allocation import Decompositions
from fisherkron.hf.speed import forward_flops

transformers.logging.set_verbosity_error()  # no load report
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
params = {k_: v for k_, v in dict(globals()).items()
          if k_ in ("profile", "model_name", "method", "ratios", "layers", "k", "batch_size", "seq_len", "calib_docs",
                    "data_profile", "mff_tol", "device", "dtype", "flop_seq_len", "forward_batch", "forward_seq_len",
                    "forward_repeats", "decode_batches", "decode_context", "decode_repeats", "warmup",
                    "layer_tokens", "layer_repeats", "keep_dense_ratios", "min_speedup", "extra_flops_model",
                    "extra_flops_ratios", "target")}
model, tok, stats = tp.load(model_name, method, k=k, batch_size=batch_size, seq_len=seq_len, calib_docs=calib_docs,
                            data_profile=data_profile, layers=layers, progress=True)
torch_dtype = getattr(torch, dtype)
print(f"{model_name}: {fk.count_params(model):,} parameters; method {method}"
      + (f", k = {stats.k} calibration batches ({'cached' if stats.from_cache else 'collected'})" if stats else ""))

# %% [markdown]
# ## FLOPs of one forward pass (Tab. flops_comparison)

# %% tags=["hide-input"]
frames = []
rows = tp.flop_rows(model, ratios, batch_size=1, seq_len=flop_seq_len, layers=layers)
frames.append(pd.DataFrame(rows).assign(model=model_name))
if extra_flops_model:
    big = tp.meta_model(tp.CONFIGS[extra_flops_model])
    frames.append(pd.DataFrame(tp.flop_rows(big, extra_flops_ratios, batch_size=1, seq_len=flop_seq_len))
                  .assign(model=extra_flops_model))
    del big
flops = pd.concat(frames, ignore_index=True)
flops["counted_equals_analytic"] = flops["counted_flops"] == flops["flops"]
paper_model = "meta-llama/Llama-2-7b-chat-hf"
flops["paper_TFLOPs"] = [tp.PAPER_FLOPS.get("full" if r == 0 else r, np.nan) / 1e12 if m == paper_model else np.nan
                         for m, r in zip(flops["model"], flops["ratio"])]
flops["paper_flop_ratio"] = flops["paper_TFLOPs"] / (tp.PAPER_FLOPS["full"] / 1e12)
flop_table = pd.DataFrame({
    "model": flops["model"], "target ratio": flops["ratio"], "params removed": flops["params_ratio"],
    "TFLOPs (analytic)": flops["flops"] / 1e12, "TFLOPs (FlopCounterMode)": flops["counted_flops"] / 1e12,
    "equal": flops["counted_equals_analytic"], "attention TFLOPs": flops["attention_flops"] / 1e12,
    "FLOPs / dense": flops["flop_ratio"], "paper TFLOPs": flops["paper_TFLOPs"],
    "paper FLOPs / dense": flops["paper_flop_ratio"]})
figures.save_table(flop_table, "tab_flops_comparison", output_dir, params, started=started,
                   notebook="notebooks/tab_throughput.py", floatfmt=".4g", label="tab:flops_comparison",
                   caption=f"FLOPs of one forward pass over {flop_seq_len} tokens (batch 1; 2 FLOPs per multiply-add "
                           f"of every matrix product), uniform per-layer ratios; analytic and counted by "
                           f"FlopCounterMode; the paper's Llama 2 7B numbers beside ours",
                   tolerances={"model": "exact", "target ratio": "exact", "params removed": "rel=1e-9",
                               "TFLOPs (analytic)": "rel=1e-9", "TFLOPs (FlopCounterMode)": "rel=1e-9", "equal": "exact",
                               "attention TFLOPs": "rel=1e-9", "FLOPs / dense": "rel=1e-9", "paper TFLOPs": "exact",
                               "paper FLOPs / dense": "rel=1e-9"})  # make verify: counted, not measured
display(Markdown(flop_table.to_markdown(index=False, floatfmt=".4g")))

# %% [markdown]
# ## Measured speed of each compressed model
# Each model is compressed from a copy of the dense one (one weighted SVD per layer, shared by all
# ratios), moved to `device` in `dtype`, timed, and freed.

# %% tags=["hide-input"]
dev = torch.device(device)
dec = Decompositions()
cases = [(r, None) for r in ratios] + [(r, min_speedup) for r in keep_dense_ratios]
measured = []
for ratio, speed_floor in cases:
    t0 = time.perf_counter()
    m = copy.deepcopy(model)
    rep = None
    if ratio > 0:
        rep = fk.compress(m, method, stats, layers, ratio=ratio, mff_options={"tol": mff_tol}, decompositions=dec,
                          min_speedup=speed_floor, speed_tokens=forward_batch * forward_seq_len)
    m = m.to(dev, torch_dtype).eval()
    t1 = time.perf_counter()
    fw = tp.time_forward(m, forward_batch, forward_seq_len, warmup=warmup, repeats=forward_repeats)
    row = {"target_ratio": ratio, "keep_dense": speed_floor is not None,
           "ratio": rep.ratio if rep else 0.0,
           "dense_layers": sum(lr.skipped is not None for lr in rep.layers.values()) if rep else 0,
           "forward_s": fw.median, "forward_tokens_per_s": fw.tokens_per_s, "forward_runs": fw.seconds,
           "forward_flops": forward_flops(m, forward_batch, forward_seq_len).total}
    for b in decode_batches:
        dc = tp.time_decode(m, b, decode_context, warmup=warmup, repeats=decode_repeats)
        row[f"decode{b}_ms"] = dc.ms_per_step
        row[f"decode{b}_runs"] = dc.seconds
        row[f"decode{b}_flops"] = forward_flops(m, b, 1, past=decode_context).total
    row.update(compress_s=t1 - t0, timing_s=time.perf_counter() - t1)
    measured.append(row)
    print(f"ratio {100 * ratio:g}%{' (keep dense if slower)' if speed_floor else ''}: achieved {row['ratio']:.1%}, "
          f"{row['dense_layers']} layers dense; forward {fw.tokens_per_s:,.0f} tokens/s; "
          + ", ".join(f"batch {b}: {row[f'decode{b}_ms']:.1f} ms/token" for b in decode_batches)
          + f" (compress {t1 - t0:.0f} s, timing {row['timing_s']:.0f} s)", flush=True)
    del m
    gc.collect()
dec.clear()
meas = pd.DataFrame(measured)
base = meas[(meas.target_ratio == 0) & ~meas.keep_dense].iloc[0]
meas["forward_speedup"] = meas["forward_tokens_per_s"] / base["forward_tokens_per_s"]
meas["forward_flop_speedup"] = base["forward_flops"] / meas["forward_flops"]
for b in decode_batches:
    meas[f"decode{b}_speedup"] = base[f"decode{b}_ms"] / meas[f"decode{b}_ms"]
    meas[f"decode{b}_flop_speedup"] = base[f"decode{b}_flops"] / meas[f"decode{b}_flops"]

# %% tags=["hide-input"]
label = [f"{100 * r:g}%" + (" (keep dense)" if kd else "") for r, kd in zip(meas.target_ratio, meas.keep_dense)]
paper_tps = [tp.PAPER_TOKENS_PER_S.get(r, np.nan) if not kd else np.nan for r, kd in zip(meas.target_ratio, meas.keep_dense)]
tab_fw = pd.DataFrame({
    "target ratio": label, "achieved ratio": meas["ratio"], "dense layers": meas["dense_layers"],
    "tokens/s": meas["forward_tokens_per_s"], "speedup": meas["forward_speedup"],
    "FLOP speedup": meas["forward_flop_speedup"], "speedup / FLOP speedup": meas["forward_speedup"] / meas["forward_flop_speedup"],
    "paper tokens/s": paper_tps, "paper speedup": np.array(paper_tps) / tp.PAPER_TOKENS_PER_S[0.0]})
figures.save_table(tab_fw, "tab_throughput_fwsvd", output_dir, params, started=started,
                   notebook="notebooks/tab_throughput.py", floatfmt=".4g", label="tab:throughput_fwsvd",
                   caption=f"Prefill throughput of {model_name} compressed by {method} (uniform ranks): batch "
                           f"{forward_batch}, {forward_seq_len} tokens, {device} {dtype}; median of {forward_repeats} "
                           f"runs. Paper: Llama 2 7B Chat, FWSVD, A100.",
                   # make verify: the keep-dense rows' ratio, dense layers and FLOPs are decided by measured
                   # layer speeds, so those columns are timing (the plain rows' FLOPs: tab_flops_comparison)
                   tolerances={"target ratio": "exact", "achieved ratio": "timing", "dense layers": "timing",
                               "tokens/s": "timing", "speedup": "timing", "FLOP speedup": "timing",
                               "speedup / FLOP speedup": "timing", "paper tokens/s": "exact",
                               "paper speedup": "rel=1e-9"})
display(Markdown(tab_fw.to_markdown(index=False, floatfmt=".4g")))
lat = []
for b in decode_batches:
    for lab, r, kd, ms, sp, fsp in zip(label, meas.target_ratio, meas.keep_dense, meas[f"decode{b}_ms"],
                                       meas[f"decode{b}_speedup"], meas[f"decode{b}_flop_speedup"]):
        lat.append({"batch": b, "context": decode_context, "target ratio": lab, "ms per token": ms, "speedup": sp,
                    "FLOP speedup": fsp,
                    "paper ms per token (1024 context)": np.nan if kd else tp.PAPER_MS_PER_TOKEN.get(b, {}).get(r, np.nan)})
tab_lat = pd.DataFrame(lat)
figures.save_table(tab_lat, "tab_throughput_forward", output_dir, params, started=started,
                   notebook="notebooks/tab_throughput.py", floatfmt=".4g", label="tab:throughput_forward",
                   caption=f"Latency of one decoding step (one token for each sequence of the batch, {decode_context} "
                           f"cached tokens) of {model_name} compressed by {method}, {device} {dtype}; median of "
                           f"{decode_repeats} steps. Paper: Llama 2 7B Chat, GFWSVD, A100, sequence length 1024.",
                   tolerances={"batch": "exact", "context": "exact", "target ratio": "exact", "ms per token": "timing",
                               "speedup": "timing", "FLOP speedup": "timing",  # keep-dense rows: decided by timing
                               "paper ms per token (1024 context)": "exact"})
display(tab_lat.pivot_table(index="target ratio", columns="batch", values="ms per token", sort=False))

# %% [markdown]
# ## Which factorised layers are slower than the dense ones?

# %%
lay = pd.DataFrame(tp.layer_rows(model.to(dev, torch_dtype), [r for r in ratios if r > 0], layer_tokens,
                                 layers=layers, repeats=layer_repeats))
lay["slower"] = lay["speedup"] < 1
figures.save_table(lay, "tab_throughput_layers", output_dir, params, started=started,
                   notebook="notebooks/tab_throughput.py", floatfmt=".4g",
                   caption=f"Each factorised layer shape timed alone against its dense layer ({device} {dtype})",
                   tolerances={"ratio": "exact", "n": "exact", "m": "exact", "rank": "exact", "layers": "exact",
                               "tokens": "exact", "dense_ms": "timing", "lowrank_ms": "timing", "speedup": "timing",
                               "flop_speedup": "rel=1e-9", "slower": "timing"})
display(lay.pivot_table(index=["n", "m", "ratio", "rank"], columns="tokens", values="speedup"))

# %% [markdown]
# ## Fig. throughput: measured speedup against FLOP speedup

# %% tags=["hide-input"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
plain = meas[~meas.keep_dense]
series = [("forward", f"forward, batch {forward_batch} x {forward_seq_len} tokens", "o")]
series += [(f"decode{b}", f"decode step, batch {b} ({decode_context} cached)", "s^Dv"[i % 4])
           for i, b in enumerate(decode_batches)]
for key, lab, mk in series:
    a1.plot(plain[f"{key}_flop_speedup"], plain[f"{key}_speedup"], marker=mk, label=lab)
    kd = meas[meas.keep_dense]
    if len(kd):
        a1.scatter(kd[f"{key}_flop_speedup"], kd[f"{key}_speedup"], marker=mk, facecolors="none", edgecolors="k",
                   s=70)
hi = max(plain[[f"{k_}_flop_speedup" for k_, _, _ in series]].max().max(), 1.05)
a1.plot([1, hi], [1, hi], color="grey", lw=1, label="speed = FLOPs")
a1.plot([1, hi], [target, target * hi], color="grey", ls="--", lw=1, label=f"{target:g} x FLOP speedup")
a1.set_xlabel("FLOP speedup (dense FLOPs / compressed FLOPs)")
a1.set_ylabel("measured speedup")
a1.set_title(f"{model_name}, {method}, uniform ranks ({device}); open markers: min_speedup={min_speedup:g}",
             fontsize="small")
a1.legend(fontsize="x-small")
a1.grid(alpha=0.3)
for t_ in layer_tokens:
    d = lay[lay.tokens == t_]
    a2.scatter(d["flop_speedup"], d["speedup"], s=18, label=f"{t_} tokens")
a2.axhline(1, color="k", lw=1)
a2.plot([lay["flop_speedup"].min(), lay["flop_speedup"].max()], [lay["flop_speedup"].min(), lay["flop_speedup"].max()],
        color="grey", lw=1)
a2.set_xlabel("FLOP speedup of the layer, n m / (r (n + m))")
a2.set_ylabel("measured speedup of the layer")
a2.set_title("each factorised layer shape alone (below 1: slower than dense)", fontsize="small")
a2.legend(fontsize="x-small")
a2.grid(alpha=0.3)
fig.tight_layout()
figures.save_figure(fig, "fig_throughput", output_dir, params, started=started, notebook="notebooks/tab_throughput.py");

# %% [markdown]
# ## Verdicts (computed from the numbers above)

# %% tags=["hide-input"]
lines, verdict = [], {}
top = plain.sort_values("target_ratio").iloc[-1]
eff = top["forward_speedup"] / top["forward_flop_speedup"]
ok = bool(eff >= target)
verdict.update(largest_ratio=top["target_ratio"], forward_speedup=top["forward_speedup"],
               forward_flop_speedup=top["forward_flop_speedup"], efficiency=eff, target_met=ok,
               counted_equals_analytic=bool(flops["counted_equals_analytic"].all()))
lines.append(f"* At {100 * top['target_ratio']:g}% ({top['ratio']:.1%} of the parameters removed) the forward pass "
             f"(batch {forward_batch}, {forward_seq_len} tokens) runs {top['forward_speedup']:.2f}x as fast as the "
             f"dense model; its FLOPs predict {top['forward_flop_speedup']:.2f}x, so the measured speedup is "
             f"{eff:.2f} of the predicted one; target at least {target:g}: **{'met' if ok else 'missed'}**.")
for b in decode_batches:
    paper = tp.PAPER_MS_PER_TOKEN.get(b)
    lines.append(f"* Decoding at batch {b} ({decode_context} cached tokens): {top[f'decode{b}_ms']:.1f} ms per token "
                 f"against {base[f'decode{b}_ms']:.1f} dense = {top[f'decode{b}_speedup']:.2f}x (FLOPs "
                 f"{top[f'decode{b}_flop_speedup']:.2f}x" + (f"; paper at 50 %: {paper[0.0] / paper[0.5]:.2f}x on an "
                                                             f"A100)." if paper else ")."))
fl = flops[flops.model == model_name].sort_values("ratio")
lines.append(f"* FLOPs: analytic and FlopCounterMode counts "
             f"{'agree exactly' if verdict['counted_equals_analytic'] else 'DIFFER'} on every row. With "
             f"{fl['params_ratio'].iloc[-1]:.1%} of the parameters removed the forward pass keeps "
             f"{fl['flop_ratio'].iloc[-1]:.1%} of its FLOPs: the LM head and attention are not compressed.")
if extra_flops_model:
    big = flops[flops.model == extra_flops_model].set_index("ratio")
    lines.append(f"* {extra_flops_model} at {flop_seq_len} tokens: {big.loc[0, 'flops'] / 1e12:.2f} TFLOPs by our count "
                 f"against the paper's {tp.PAPER_FLOPS['full'] / 1e12:.2f} T ({tp.PAPER_FLOPS['full'] / big.loc[0, 'flops']:.1f}x), "
                 f"and at 50 % {big.loc[0.5, 'flop_ratio']:.2f} of dense against the paper's "
                 f"{tp.PAPER_FLOPS[0.5] / tp.PAPER_FLOPS['full']:.2f}; the paper does not say how it counted.")
slow = lay[lay.slower]
if len(slow):
    desc = "; ".join(f"{int(r.n)}x{int(r.m)} at rank {int(r['rank'])} ({100 * r.ratio:g}%) on {int(r.tokens)} tokens: "
                     f"{r.speedup:.2f}x" for _, r in slow.iterrows())
    lines.append(f"* Factorised layers slower than dense ({len(slow)} of {len(lay)} shape/rank/token cases): {desc}.")
else:
    lines.append(f"* Every factorised layer shape is faster than its dense layer at every measured token count.")
verdict["slower_layer_cases"] = int(len(slow))
verdict["keep_dense"] = []
for _, r in meas[meas.keep_dense].iterrows():
    same = plain[np.isclose(plain.target_ratio, r["target_ratio"])]
    ref = (f" (all factorised: ratio {same['ratio'].iloc[0]:.1%}, forward {same['forward_speedup'].iloc[0]:.2f}x)"
           if len(same) else "")
    lines.append(f"* With min_speedup={min_speedup:g} at {100 * r['target_ratio']:g}%: {int(r['dense_layers'])} "
                 f"layers kept dense, ratio {r['ratio']:.1%}; forward {r['forward_speedup']:.2f}x{ref}.")
    verdict["keep_dense"].append({"target_ratio": r["target_ratio"], "dense_layers": int(r["dense_layers"]),
                                  "ratio": float(r["ratio"]), "forward_speedup": float(r["forward_speedup"])})
display(Markdown("\n".join(lines)))
figures.write_provenance(output_dir, "tab_throughput_summary",
                         figures.provenance("tab_throughput_summary", params, started=started,
                                            notebook="notebooks/tab_throughput.py",
                                            extra={"verdict": verdict, "lines": lines}));
