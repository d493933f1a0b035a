#!/usr/bin/env python
r"""Benchmark MFF against the authors' approach: the tables and figure of the README's speed section.

Synthetic layer sizes, one real MiniLM layer head to head, and all 36 MiniLM layers; each
with fisherkron's MFF (K-FAC and default starts, median of repeats) and the authors' ``svds``
approach (float64 as published, and float32), against a float64 reference. What is measured
lives in :mod:`fisherkron.experiments.benchmark`; this script runs it, prints a line per case
and writes ``bench_mff.{csv,md,tex}``, ``bench_minilm_layers.{csv,md,tex}`` and
``fig_bench_mff.{png,pdf}`` with provenance records (``make bench``; ``--replot`` redraws the
figure from the tables; ``--quick`` runs tiny sizes in seconds).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fisherkron.core.conventions import FisherkronError
from fisherkron.experiments.benchmark import (bench_case, gemm_peak, minilm_calibration, peak_rss_mib,
                                              whole_model)
from fisherkron.repro.figures import save_figure, save_table
from fisherkron.experiments.synthetic_gradients import synthetic_gradients


def _parse_size(s: str) -> tuple[int, int, int]:
    try:
        n, m, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {s!r} must look like 768x384x16 (n x m x k)") from None
    return n, m, k


def _fmt_table(df) -> str:
    cols = [c for c in ["case", "n", "m", "k", "ours_s", "authors_s", "speedup", "authors_f32_s", "speedup_vs_f32",
                        "ident_s", "speedup_ident", "ours_matvecs", "ident_matvecs", "authors_matvecs",
                        "ours_gflops", "peak_gflops", "ours_pct_peak", "ours_err", "ident_err",
                        "authors_err", "authors_status"] if c in df.columns]
    return df[cols].to_markdown(index=False, floatfmt=".3g") if _has_tabulate() else df[cols].to_string()


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print each case and write the tables and the figure."""
    import pandas as pd


    p = argparse.ArgumentParser(prog="scripts/bench_mff.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=_parse_size,
                   default=[(768, 384, 16), (1536, 384, 32), (3072, 768, 16)],
                   help="synthetic layer sizes n x m x k (default: 768x384x16 1536x384x32 3072x768x16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (gradients and GEMMs stay on it)")
    p.add_argument("--out", default="figures/bench", help="output folder (CSV + Markdown + LaTeX)")
    p.add_argument("--tol", type=float, default=1e-4, help="MFF stop: estimated relative error of A (x) B (default 1e-4)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per synthetic batch")
    p.add_argument("--authors-limit", type=float, default=420.0,
                   help="seconds after which the authors' svds is stopped and its time extrapolated")
    p.add_argument("--no-authors", action="store_true", help="skip the authors' approach")
    p.add_argument("--no-authors-f32", action="store_true",
                   help="skip the float32 variant of the authors' approach (the float64 one, as their scripts run, "
                        "is always timed unless --no-authors)")
    p.add_argument("--repeats", type=int, default=3, help="runs of fisherkron's MFF per case (median reported)")
    p.add_argument("--authors-on-cuda", action="store_true",
                   help="with --device cuda, still run the authors' (CPU, numpy) approach (skipped by default)")
    p.add_argument("--no-reference", action="store_true", help="skip the float64 reference (no error column)")
    p.add_argument("--minilm-layer", default="bert.encoder.layer.3.attention.output.dense",
                   help="real MiniLM layer for the head-to-head row ('none' to skip)")
    p.add_argument("--no-whole-model", action="store_true", help="skip factorising all 36 MiniLM layers")
    p.add_argument("--k-minilm", type=int, default=32, help="batches of MiniLM gradients")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no MiniLM (seconds; for smoke tests)")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only redraw fig_bench_mff.{png,pdf} from the CSV tables already in --out (no timing)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if a.replot:
        return _replot(a.out)
    if a.quick:
        a.sizes, a.minilm_layer, a.no_whole_model = [(48, 32, 8), (96, 48, 8)], "none", True
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FisherkronError("--device cuda was asked for but torch sees no CUDA device")
    if device.type == "cuda" and not a.authors_on_cuda:
        a.no_authors = True  # numpy/ARPACK on the host: one product of an 11008 x 4096 layer takes many minutes
    started = time.perf_counter()
    print(f"# fisherkron MFF benchmark on {device} ({torch.get_num_threads()} CPU threads, torch {torch.__version__})",
          flush=True)
    peak = gemm_peak(device, seconds=0.5 if a.quick else 4.0, size=1024 if a.quick else None)
    print(f"float32 GEMM peak measured: {peak:.1f} GFLOP/s", flush=True)
    rows: list[dict] = []
    counts: list[int] = []
    for (n, m, k) in a.sizes:
        syn = synthetic_gradients(n, m, k, tokens=a.tokens, device=device)
        kf = syn.kfac()
        G = syn.G
        del syn
        hint = max(counts) if counts else None
        row = bench_case(f"synthetic {n}x{m}x{k}", G, kf, peak=peak, tol=a.tol, authors=not a.no_authors,
                         authors_f32=not a.no_authors_f32, repeats=a.repeats,
                         authors_limit=a.authors_limit, authors_count_hint=hint,
                         reference=not a.no_reference, device=device)
        if row.get("authors_status") == "measured":
            counts.append(row["authors_matvecs"])
        rows.append(row)
        print(_row_line(row), flush=True)
        del G
    stats = None
    collect_s = float("nan")
    if a.minilm_layer != "none" or not a.no_whole_model:
        stats, collect_s = minilm_calibration(k=a.k_minilm, progress=a.progress)
        print(f"MiniLM gradients of {len(stats.layers)} layers, k={stats.k}: {collect_s:.1f} s "
              f"({'read from cache' if stats.from_cache else 'collected'})", flush=True)
    if a.minilm_layer != "none":
        if a.minilm_layer not in stats.layers:
            raise FisherkronError(f"--minilm-layer {a.minilm_layer} is not a MiniLM linear layer; "
                                  f"e.g. {next(iter(stats.layers))}")
        G = torch.from_numpy(np.array(stats.grads(a.minilm_layer)))
        row = bench_case(f"MiniLM {a.minilm_layer}", G, stats.kfac(a.minilm_layer), peak=peak, tol=a.tol,
                         authors=not a.no_authors, authors_f32=not a.no_authors_f32, repeats=a.repeats,
                         authors_limit=a.authors_limit,
                         authors_count_hint=max(counts) if counts else None,
                         reference=not a.no_reference, device=device)
        rows.append(row)
        print(_row_line(row), flush=True)
    peak_end = gemm_peak(device, seconds=0.5 if a.quick else 3.0, size=1024 if a.quick else None)
    df = pd.DataFrame(rows)
    df["peak_gflops"] = max(peak, peak_end)  # the best GEMM throughput seen in this run
    df["ours_pct_peak"] = 100 * df["ours_gflops"] / df["peak_gflops"]
    params = {k_: (list(map(list, v)) if k_ == "sizes" else v) for k_, v in vars(a).items()}
    extra = {"gemm_peak_gflops_start": peak, "gemm_peak_gflops_end": peak_end,
             "load_average": os.getloadavg()}
    save_table(df, "bench_mff", a.out, params, started=started, notebook="scripts/bench_mff.py",
               caption="MFF (fisherkron) against the authors' svds approach on the same gradients",
               label="tab:bench_mff", floatfmt=".3g", extra=extra)
    print("\n" + _fmt_table(df) + "\n", flush=True)
    wdf_all = None
    if not a.no_whole_model:
        wdfs, walls = [], {}
        for init in ("kfac", "identity"):
            wrows, walls[init] = whole_model(stats, tol=a.tol, device=device, progress=a.progress, init=init)
            wdf = pd.DataFrame(wrows)
            wdfs.append(wdf)
            mv = wdf["matvecs"]
            print(f"whole MiniLM, {init} start: {len(wdf)} layers factorised in {walls[init]:.1f} s end to end "
                  f"(matvecs per layer: median {mv.median():.0f}, min {mv.min()}, max {mv.max()}; "
                  f"<= 6 on {int((mv <= 6).sum())}/{len(wdf)} layers; all converged: {bool(wdf['converged'].all())})",
                  flush=True)
        wdf_all = pd.concat(wdfs, ignore_index=True)
        save_table(wdf_all, "bench_minilm_layers", a.out, params, started=started,
                   notebook="scripts/bench_mff.py",
                   caption="MFF of all MiniLM linear layers (K-FAC and identity starts)",
                   label="tab:bench_minilm_layers", floatfmt=".3g",
                   extra={"end_to_end_seconds": walls["kfac"], "end_to_end_seconds_identity": walls["identity"],
                          "collection_seconds": collect_s, "collection_from_cache": stats.from_cache})
    _save_bench_figure(df, wdf_all, a.out, params, started=started, notebook="scripts/bench_mff.py", extra=extra)
    print(f"GEMM peak: {peak:.1f} GFLOP/s at start, {peak_end:.1f} at end; load average {os.getloadavg()}; "
          f"peak RSS {peak_rss_mib():.0f} MiB; total {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def plot_bench(df, layers=None, target: float = 30.0):
    """Figure of a benchmark table: seconds per case and solver, speedups, matvecs per MiniLM layer.

    ``df``: the ``bench_mff`` rows; ``layers``: the ``bench_minilm_layers`` rows (optional).
    """
    import matplotlib.pyplot as plt

    cases = [c.replace("synthetic ", "syn ").replace("MiniLM bert.encoder.", "MiniLM ").replace("attention.output.dense", "attn.out")
             for c in df["case"]]
    solvers = [("ours_s", "fisherkron, K-FAC start"), ("ident_s", "fisherkron, default start"),
               ("authors_f32_s", "authors' svds in float32"), ("authors_s", "authors' svds, float64 (as published)")]
    solvers = [(c, lab) for c, lab in solvers if c in df.columns]
    panels = 3 if layers is not None and len(layers) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6))
    y = np.arange(len(cases))
    h = 0.8 / max(len(solvers), 1)
    ax = axes[0]
    for j, (col, lab) in enumerate(solvers):
        ax.barh(y + (j - (len(solvers) - 1) / 2) * h, df[col], height=h, label=lab)
    ax.set_xscale("log")
    ax.set_yticks(y, cases)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (log scale)")
    ax.set_title("time to factorise one layer")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax = axes[1]
    speed = [(c, lab) for c, lab in [("speedup", "K-FAC start"), ("speedup_ident", "default start"),
                                      ("speedup_vs_f32", "K-FAC start vs float32 svds")] if c in df.columns]
    h2 = 0.8 / max(len(speed), 1)
    for j, (col, lab) in enumerate(speed):
        ax.barh(y + (j - (len(speed) - 1) / 2) * h2, df[col], height=h2, label=lab)
    ax.axvline(target, color="k", ls=":", label=f"target {target:.0f}x")
    ax.set_yticks(y, [""] * len(cases))
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the authors' approach (x)")
    ax.set_title("speedup on the same gradients")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    if panels == 3:
        ax = axes[2]
        starts = list(dict.fromkeys(layers["start"])) if "start" in layers.columns else [None]
        top = int(layers["matvecs"].max())
        bins = np.arange(1.5, top + 1.5)
        mvs = [layers["matvecs"] if st is None else layers.loc[layers["start"] == st, "matvecs"] for st in starts]
        ax.hist(mvs, bins=bins, label=[f"{st} start (median {mv.median():.0f})" for st, mv in zip(starts, mvs)])
        ax.axvline(6.5, color="k", ls=":", label="target: <= 6")
        ax.set_xticks(range(2, top + 1, 2))
        ax.set_xlabel("matvecs per layer")
        ax.set_ylabel("layers")
        ax.set_title(f"whole MiniLM: {len(layers) // max(len(starts), 1)} layers")
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    return fig


def _row_line(r: dict) -> str:
    s = (f"{r['case']}: ours {r['ours_s']:.2f} s, {r['ours_matvecs']} matvecs, {r['ours_gflops']:.0f} GFLOP/s "
         f"executed ({r['ours_pct_peak']:.0f}% of peak; {r['ours_effective_gflops']:.0f} effective)")
    if "ours_err" in r:
        s += f", err {r['ours_err']:.1e}"
    if "ident_s" in r:
        s += f" | identity start {r['ident_s']:.2f} s, {r['ident_matvecs']} matvecs"
    if "ident_err" in r:
        s += f", err {r['ident_err']:.1e}"
    if "authors_s" in r:
        s += (f" | authors (float64, as published) {r['authors_s']:.1f} s, {r['authors_matvecs']} products "
              f"({r['authors_status']}), speedup {r['speedup']:.0f}x")
    if "speedup_ident" in r:
        s += f" (identity start {r['speedup_ident']:.0f}x)"
    if "authors_err" in r:
        s += f", err {r['authors_err']:.1e}"
    if "authors_f32_s" in r:
        s += f" | authors in float32 {r['authors_f32_s']:.1f} s, speedup {r['speedup_vs_f32']:.0f}x"
    return s


def _save_bench_figure(df, layers, out, params, **provenance) -> None:
    """Draw :func:`plot_bench` off-screen and write ``<out>/fig_bench_mff.{png,pdf}`` with its provenance."""
    import matplotlib
    matplotlib.use("Agg")
    save_figure(plot_bench(df, layers), "fig_bench_mff", out, params, **provenance)


def _replot(out: str) -> int:
    """Redraw ``fig_bench_mff.{png,pdf}`` from ``<out>/bench_mff.csv`` (and ``bench_minilm_layers.csv``)."""
    import pandas as pd

    folder = Path(out)
    table = folder / "bench_mff.csv"
    if not table.exists():
        raise FisherkronError(f"--replot: {table} does not exist; run the benchmark first (make bench)")
    layers = folder / "bench_minilm_layers.csv"
    wdf = pd.read_csv(layers) if layers.exists() else None
    _save_bench_figure(pd.read_csv(table), wdf, folder, {"replot_of": [str(table), str(layers)]},
                       notebook="scripts/bench_mff.py (--replot)")
    print(f"wrote {folder / 'fig_bench_mff.png'} from {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
