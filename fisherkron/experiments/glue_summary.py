r"""Tables and verdicts of the encoder study (Sec. 6.2) from the rows of :meth:`fisherkron.experiments.glue.Study.run`.

Every number is a mean over fine-tuning seeds with its spread (sample standard deviation); a
method is compared with another *per seed* (both compress the same fine-tuned model), so a
lead is the mean of the per-seed differences, with its standard error ``se = sd / sqrt(n)``.

* :func:`frame` -- the rows as a DataFrame (the dense model is ``rank = 0``);
* :func:`macro` -- per (method, rank, seed), the macro average over tasks of each task's metric;
* :func:`results_table` (Tab. glue_results), :func:`extended_table` (Tab. glue_extended);
* :func:`verdicts` -- the paper's three claims, each "holds", "holds in part" or "does not
  hold at this scale", with the numbers behind it.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = ["NAMES", "frame", "macro", "learned_tasks", "mean_sd", "fmt", "paired_lead", "results_table", "extended_table",
           "normalised", "verdicts", "HOLDS", "PART", "NOT"]

NAMES = {"dense": "uncompressed", "svd": "SVD", "asvd": "ASVD", "fwsvd": "FWSVD", "gfwsvd": "GFWSVD",
         "svd_llm": "SVD-LLM", "kfac_svd": "KFAC-SVD"}
TASK_NAMES = {"sst2": "SST-2", "boolq": "BoolQ", "trec": "TREC-6", "mrpc": "MRPC", "rte": "RTE"}
HOLDS, PART, NOT = "holds", "holds in part", "does not hold at this scale"


def frame(rows) -> pd.DataFrame:
    """The study's rows as a DataFrame; the uncompressed model has ``rank = 0`` and ``ratio = 0``."""
    df = pd.DataFrame(list(rows))
    df["rank"] = df["rank"].fillna(0).astype(int)
    return df


def mean_sd(x) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and count."""
    x = np.asarray(x, dtype=float)
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0, len(x)


def fmt(mean: float, sd: float, digits: int = 3) -> str:
    """``"0.771 ± 0.012"``."""
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def macro(df: pd.DataFrame) -> pd.DataFrame:
    """Per (method, rank, seed): the mean of the reported metric over the tasks. A (method, rank,
    seed) that lacks a task is dropped, so every average covers the same tasks."""
    n = df["task"].nunique()
    g = df.groupby(["method", "rank", "seed"])["metric"].agg(["mean", "count"]).reset_index()
    return g[g["count"] == n].drop(columns="count").rename(columns={"mean": "macro"})


def paired_lead(m: pd.DataFrame, a: str, b: str, rank: int) -> dict:
    """``a - b`` of the macro average at ``rank``, seed by seed: mean, sd, se, n."""
    x = m[(m["method"] == a) & (m["rank"] == rank)].set_index("seed")["macro"]
    y = m[(m["method"] == b) & (m["rank"] == rank)].set_index("seed")["macro"]
    d = (x - y).dropna()
    mean, sd, n = mean_sd(d.values) if len(d) else (float("nan"), float("nan"), 0)
    return {"mean": mean, "sd": sd, "se": sd / math.sqrt(n) if n else float("nan"), "n": n}


def _ratios(df: pd.DataFrame) -> dict[int, float]:
    comp = df[df["method"] != "dense"]
    return comp.groupby("rank")["ratio"].mean().to_dict()


def results_table(df: pd.DataFrame, methods, ranks) -> pd.DataFrame:
    """Tab. glue_results: macro average (mean ± sd over seeds) per method (rows) and rank (columns),
    with the whole-model compression ratio, the uncompressed model and the best method per rank."""
    m = macro(df)
    ratio = _ratios(df)
    cols = [str(r) for r in ranks]
    out = [{"Method / Rank": "compression ratio", **{str(r): f"{100 * ratio.get(r, float('nan')):.1f} %"
                                                      for r in ranks}}]
    dense = mean_sd(m[m["method"] == "dense"]["macro"])
    out.append({"Method / Rank": "uncompressed", **{c: fmt(*dense[:2]) for c in cols}})
    means = {}
    for meth in methods:
        row = {"Method / Rank": NAMES.get(meth, meth)}
        for r in ranks:
            mu, sd, _ = mean_sd(m[(m["method"] == meth) & (m["rank"] == r)]["macro"])
            row[str(r)] = fmt(mu, sd)
            means[meth, r] = round(mu, 9)
        out.append(row)
    best = {r: " = ".join(NAMES.get(x, x) for x in methods
                          if means[x, r] == max(means[y, r] for y in methods)) for r in ranks}
    out.append({"Method / Rank": "best (mean)", **{str(r): best[r] for r in ranks}})
    return pd.DataFrame(out)


def extended_table(df: pd.DataFrame, methods, ranks, tasks, setup: dict[str, dict]) -> pd.DataFrame:
    """Tab. glue_extended: each task's metric (mean ± sd over seeds) per rank block and method, the
    macro average, and the protocol of each task (``setup[task]``: ``lr``, ``sizes``, ``max_length``)."""
    from .glue import TASK_SPECS

    head = {t: f"{TASK_NAMES.get(t, t)} ({TASK_SPECS[t].metric})" for t in tasks}
    ratio = _ratios(df)
    m = macro(df)
    rows = []

    def line(block, name, values, avg=""):
        rows.append({"block": block, "method": name, **{head[t]: values[t] for t in tasks}, "macro avg": avg})

    line("setup", "learning rate (dev search)", {t: f"{setup[t]['lr']:g}" for t in tasks})
    line("setup", "train / dev / test examples", {t: setup[t]["sizes"] for t in tasks})
    line("setup", "max tokens (test truncated)", {t: setup[t]["max_length"] for t in tasks})
    triv = {t: df[(df.task == t) & (df.method == "dense")]["trivial"].mean() for t in tasks}
    line("reference", "majority class", {t: f"{triv[t]:.3f}" for t in tasks}, f"{np.mean(list(triv.values())):.3f}")
    for r in [0, *ranks]:
        block = "reference" if r == 0 else f"r = {r} (ratio {100 * ratio.get(r, float('nan')):.1f} %)"
        for meth in (["dense"] if r == 0 else methods):
            vals = {}
            for t in tasks:
                mu, sd, _ = mean_sd(df[(df.task == t) & (df.method == meth) & (df["rank"] == r)]["metric"])
                vals[t] = fmt(mu, sd)
            mu, sd, _ = mean_sd(m[(m["method"] == meth) & (m["rank"] == r)]["macro"])
            line(block, NAMES.get(meth, meth), vals, fmt(mu, sd))
    return pd.DataFrame(rows)


def normalised(df: pd.DataFrame) -> pd.DataFrame:
    """Per (task, method, rank): the mean metric over seeds and its share of the dense model's margin over
    the majority class, ``s = (metric - trivial) / (dense - trivial)`` (1: as dense, 0: no better than chance)."""
    mean = df.groupby(["task", "method", "rank"])["metric"].mean().reset_index()
    dense = mean[mean["method"] == "dense"].set_index("task")["metric"]
    triv = df[df["method"] == "dense"].groupby("task")["trivial"].mean()
    mean["margin"] = mean["task"].map(dense - triv)
    mean["s"] = (mean["metric"] - mean["task"].map(triv)) / mean["margin"]
    return mean


def learned_tasks(df: pd.DataFrame, min_margin: float = 0.05) -> list[str]:
    """The tasks whose uncompressed model beats the majority class by at least ``min_margin`` (the others
    cannot show what compression loses)."""
    s = normalised(df)
    return sorted(set(s.loc[s["margin"] >= min_margin, "task"]))


def _grade(ok: int, total: int) -> str:
    return HOLDS if total and ok == total else PART if ok else NOT


def verdicts(df: pd.DataFrame, ranks, *, ours: str = "gfwsvd", rivals=("svd", "asvd", "fwsvd"),
             baselines=("fwsvd", "svd"), n_low: int = 3, n_high: int = 2, aggressive: int = 3,
             collapse_below: float = 0.25, others_above: float = 0.5, min_margin: float = 0.05,
             win_task: str = "sst2") -> dict[str, dict]:
    """The paper's claims of Sec. 6.2, tested on the study's numbers.

    * ``best``: at each rank, ``ours`` is best or tied: its seed-paired lead over every rival is
      ``>= -se`` (within one standard error of a tie). Holds at every rank / at some / at none.
    * ``lead_grows``: for each baseline, the mean lead over the ``n_low`` lowest ranks exceeds the
      mean lead over the ``n_high`` highest by more than one standard error (per seed).
    * ``asvd``: ASVD *collapses* on a task if at some rank its normalised score (:func:`normalised`)
      is ``<= collapse_below`` while the best of ``rivals``-but-ASVD and ``ours`` keeps
      ``>= others_above`` (tasks whose dense model beats the majority class by ``>= min_margin``);
      and it *wins* on ``win_task`` at aggressive compression (the ``aggressive`` lowest ranks) if
      its seed-paired lead over ``ours`` there exceeds one standard error at some rank.
    """
    ranks = sorted(ranks, reverse=True)
    present = set(df["method"])
    rivals = [b for b in rivals if b in present]
    baselines = [b for b in baselines if b in present]
    m = macro(df)
    out = {}
    if ours not in present or not rivals:
        return {k: {"verdict": "not judged", "text": f"{NAMES.get(ours, ours)} or its rivals were not run"}
                for k in ("best", "lead_grows", "asvd")}
    # 1. best or tied at each rank
    per_rank, ok = [], 0
    for r in ranks:
        leads = {b: paired_lead(m, ours, b, r) for b in rivals}
        good = all(v["mean"] >= -v["se"] if v["n"] > 1 else v["mean"] >= 0 for v in leads.values())
        ok += good
        worst = min(leads, key=lambda b: leads[b]["mean"])
        per_rank.append(f"r={r}: {'yes' if good else 'no'} (closest {NAMES[worst]}: lead "
                        f"{leads[worst]['mean']:+.3f} ± {leads[worst]['se']:.3f} se)")
    out["best"] = {"verdict": _grade(ok, len(ranks)), "ranks_ok": ok, "ranks": len(ranks),
                   "text": f"{NAMES[ours]} best or tied at {ok} of {len(ranks)} ranks; " + "; ".join(per_rank)}
    # 2. the lead grows as the rank falls
    low, high = ranks[-n_low:], ranks[:n_high]
    parts, ok = [], 0
    def lead(b, rs):  # per seed: ours - b, averaged over the ranks rs
        per = [m[(m["method"] == ours) & (m["rank"] == r)].set_index("seed")["macro"]
               - m[(m["method"] == b) & (m["rank"] == r)].set_index("seed")["macro"] for r in rs]
        return pd.concat(per, axis=1).mean(axis=1)

    for b in baselines:
        d = (lead(b, low) - lead(b, high)).dropna()
        mu, sd, n = mean_sd(d.values)
        se = sd / math.sqrt(n)
        grows = mu > se if n > 1 else mu > 0
        ok += grows
        parts.append(f"vs {NAMES[b]}: lead {lead(b, high).mean():+.3f} at r in {high} -> {lead(b, low).mean():+.3f} at "
                     f"r in {low} (growth {mu:+.3f} ± {se:.3f} se, {'grows' if grows else 'does not grow'})")
    out["lead_grows"] = ({"verdict": _grade(ok, len(baselines)), "text": "; ".join(parts)} if baselines else
                         {"verdict": "not judged", "text": "FWSVD and SVD were not run"})
    # 3. ASVD collapses on some tasks and wins on SST-2 at aggressive compression
    if "asvd" not in present:
        out["asvd"] = {"verdict": "not judged", "collapsed": [], "wins": [], "text": "ASVD was not run"}
        return out
    s = normalised(df)
    s = s[s["task"].isin(learned_tasks(df, min_margin))]
    others = [x for x in (*rivals, ours) if x != "asvd"]
    collapsed = []
    for task, g in s.groupby("task"):
        for r in ranks:
            a = g[(g["method"] == "asvd") & (g["rank"] == r)]["s"]
            o = g[g["method"].isin(others) & (g["rank"] == r)]["s"]
            if len(a) and len(o) and a.iloc[0] <= collapse_below and o.max() >= others_above:
                collapsed.append(f"{TASK_NAMES.get(task, task)} at r={r} (ASVD {a.iloc[0]:.2f} of the dense "
                                 f"margin, best other {o.max():.2f})")
                break
    skipped = sorted(set(df["task"]) - set(s["task"]))
    wins = []
    if win_task in set(df["task"]):
        one = df[df["task"] == win_task].rename(columns={"metric": "macro"})
        for r in ranks[-aggressive:]:
            v = paired_lead(one, "asvd", ours, r)
            if v["n"] and (v["mean"] > v["se"] if v["n"] > 1 else v["mean"] > 0):
                wins.append(f"r={r} (+{v['mean']:.3f} ± {v['se']:.3f} se)")
    ok = bool(collapsed) + bool(wins)
    out["asvd"] = {"verdict": _grade(ok, 2), "collapsed": collapsed, "wins": wins,
                   "text": (f"ASVD collapses on {len(collapsed)} task(s): {'; '.join(collapsed) or 'none'}"
                            + (f" (not judged, dense within {min_margin} of the majority class: "
                               f"{', '.join(TASK_NAMES.get(t, t) for t in skipped)})" if skipped else "")
                            + f". ASVD beats {NAMES[ours]} on {TASK_NAMES.get(win_task, win_task)} at the "
                            f"{aggressive} lowest ranks: {'; '.join(wins) or 'at none'}.")}
    return out
