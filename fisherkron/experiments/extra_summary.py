r"""The table and verdicts of the learned-truncation and LoRA study (Tab. extra-compression-results, paper Sec. 6.4).

:mod:`fisherkron.experiments.extra_compression` scores every row (a method at a ratio, at one stage, with a
seed); this module turns those rows into what the notebook shows: each row's name (:func:`row_name`), the mean
and spread over seeds (:func:`aggregate`), the table in the paper's layout (:func:`results_table`), and the
comparisons its verdicts rest on: whether one method is ahead of another on every seed (:func:`ahead`) or on
average (:func:`leads`), how a lead changes from one stage to the next (:func:`lead_change`, :func:`standing`),
what rebalancing the factors does (:func:`rebalance_effect`), whether a ratio collapsed every row
(:func:`all_collapsed`), and the training curves (:func:`training_curves`).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = ["STAGES", "STAGE_NAMES", "COLUMNS", "COLUMN_NAMES", "TASKS4", "row_name", "aggregate", "results_table",
           "ahead", "leads", "lead_change", "standing", "rebalance_effect", "all_collapsed", "training_curves"]

#: (a) at the allocated ranks, (b) learned truncation, (c) LoRA recovery after (b)
STAGES = ("allocated", "dobi", "lora")
STAGE_NAMES = {"allocated": "at allocated ranks", "dobi": "learned truncation (Dobi)", "lora": "+ LoRA recovery"}
#: the paper's columns: Wikipedia-text (WikiText-2's role) and PTB perplexity, four zero-shot accuracies
COLUMNS = ("ppl_wiki", "ppl_ptb", "arc_easy", "arc_challenge", "piqa", "hellaswag")
COLUMN_NAMES = {"ppl_wiki": "Wiki (WT2 role)", "ppl_ptb": "PTB", "arc_easy": "ARC-E", "arc_challenge": "ARC-C",
                "piqa": "PIQA", "hellaswag": "HSwag", "acc4": "Avg (4)", "loss": "C4 held-out loss"}
#: the four zero-shot tasks of the paper's table (the decoder study evaluates six; these are reported)
TASKS4 = ("arc_easy", "arc_challenge", "piqa", "hellaswag")
_NAMES = {"svd": "SVD", "svd_llm": "SVD-LLM", "gfwsvd": "GFWSVD", "dense": "Full model"}


def row_name(method: str, stage: str, rebalance: bool = False) -> str:
    """The table's name of a row: ``SVD``, ``Dobi-SVD``, ``Dobi-SVD + LoRA``, ``... (rebalanced)``.

    >>> row_name("gfwsvd", "lora", True)
    'Dobi-GFWSVD + LoRA (rebalanced)'
    """
    name = _NAMES.get(method, method)
    if stage == "allocated" or method == "dense":
        return name
    name = f"Dobi-{name}"
    if stage == "lora":
        name += " + LoRA" + (" (rebalanced)" if rebalance else "")
    return name


def aggregate(rows: pd.DataFrame, columns=(*COLUMNS, "acc4", "loss", "ratio")) -> pd.DataFrame:
    """Mean, sample standard deviation (``ddof=1``; 0 for one seed), min, max and count over seeds of every
    ``column`` per (method, target, stage, rebalance); the accuracy's lm-eval standard error is averaged
    (``<task>_se``). One row per group, in the order of first appearance.

    >>> df = pd.DataFrame({"method": ["svd"] * 2, "target": [0.2] * 2, "stage": ["dobi"] * 2, "seed": [0, 1],
    ...                    "rebalance": [False] * 2, "ppl_ptb": [10.0, 12.0]})
    >>> a = aggregate(df, ["ppl_ptb"]).to_dict("records")[0]
    >>> a["ppl_ptb"], round(a["ppl_ptb_sd"], 4), a["ppl_ptb_min"], a["ppl_ptb_max"], a["n"]
    (11.0, 1.4142, 10.0, 12.0, 2)
    """
    keys = ["method", "target", "stage", "rebalance"]
    out = []
    for _, g in rows.groupby(keys, sort=False, dropna=False):
        rec = {k: g.iloc[0][k] for k in keys}
        rec["name"] = g.iloc[0].get("name", row_name(rec["method"], rec["stage"], bool(rec["rebalance"])))
        rec["n"] = int(len(g))
        for c in columns:
            if c not in g:
                continue
            v = g[c].to_numpy(float)
            rec[c] = float(np.mean(v))
            rec[f"{c}_sd"] = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
            rec[f"{c}_min"], rec[f"{c}_max"] = float(np.min(v)), float(np.max(v))
            if f"{c}_se" in g:
                rec[f"{c}_se"] = float(np.mean(g[f"{c}_se"].to_numpy(float)))
        out.append(rec)
    return pd.DataFrame(out)


def _cell(mean: float, sd: float, n: int, ppl: bool) -> str:
    from .llm_summary import fmt_ppl

    if mean is None or not math.isfinite(mean):
        return ""
    core = fmt_ppl(mean) if ppl else f"{mean:.3f}"
    if n <= 1:
        return core
    spread = fmt_ppl(sd) if ppl else f"{sd:.3f}"
    return f"{core} ± {spread}"


def _bold(cells: list[str], values: list[float], higher: bool) -> list[str]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return cells
    best = max(finite) if higher else min(finite)
    return [f"**{c}**" if math.isfinite(v) and v == best and c else c for c, v in zip(cells, values)]


def results_table(agg: pd.DataFrame, ratios, dense: dict, allocation: str = "fisher",
                  columns=(*COLUMNS, "acc4")) -> pd.DataFrame:
    """Tab. extra-compression-results: per ratio one block per stage, the methods' rows in it; each cell
    ``mean ± sd`` over seeds (the (a) rows are deterministic); best per block in bold; the dense model first."""
    heads = [(COLUMN_NAMES[c], c, c.startswith("ppl")) for c in columns]
    out = [{"Block": "", "Method": _NAMES["dense"], "C. Ratio": "0 %",
            **{h: _cell(dense.get(c, float("nan")), 0.0, 1, ppl) for h, c, ppl in heads}}]
    for target in ratios:
        for stage in STAGES:
            sub = agg[np.isclose(agg["target"].astype(float), target) & (agg["stage"] == stage)]
            if sub.empty:
                continue
            label = STAGE_NAMES[stage] + (f" ({allocation})" if stage == "allocated" else "")
            recs = [r for _, r in sub.iterrows()]
            cells = [{"Method": r["name"], "C. Ratio": f"{100 * r['ratio']:.1f} %"} for r in recs]
            for h, c, ppl in heads:
                vals = [float(r.get(c, float("nan"))) for r in recs]
                col = [_cell(float(r.get(c, float("nan"))), float(r.get(f"{c}_sd", 0.0)), int(r["n"]), ppl)
                       for r in recs]
                for cell, v in zip(cells, _bold(col, vals, higher=not ppl)):
                    cell[h] = v
            out += [{"Block": f"{100 * target:g} %, {label}", **c} for c in cells]
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- verdicts

def _values(rows: pd.DataFrame, method: str, target: float, stage: str, column: str, rebalance: bool = False):
    sub = rows[(rows["method"] == method) & np.isclose(rows["target"].astype(float), target)
               & (rows["stage"] == stage) & (rows["rebalance"].astype(bool) == rebalance)]
    seeds = sub["seed"].fillna(-1).astype(int) if "seed" in sub else pd.Series(-1, index=sub.index)  # (a): no seed
    order = np.argsort(seeds.to_numpy(), kind="stable")
    return sub[column].to_numpy(float)[order], seeds.to_numpy()[order].tolist()


def ahead(rows: pd.DataFrame, target: float, stage: str, ours: str, other: str, column: str) -> dict:
    """Is ``ours`` ahead of ``other`` by more than the seed spread? ``separated``: the worst seed of ``ours`` beats
    the best seed of ``other`` (lower perplexity, or higher accuracy for a non-``ppl`` column); ``diff``: the
    difference of the means, positive when ``ours`` is better.

    >>> df = pd.DataFrame({"method": ["a", "a", "b", "b"], "target": 0.2, "stage": "dobi", "seed": [0, 1, 0, 1],
    ...                    "rebalance": False, "ppl_ptb": [10.0, 11.0, 11.5, 12.0]})
    >>> r = ahead(df, 0.2, "dobi", "a", "b", "ppl_ptb"); r["separated"], r["diff"]
    (True, 1.25)
    """
    a, _ = _values(rows, ours, target, stage, column)
    b, _ = _values(rows, other, target, stage, column)
    if not len(a) or not len(b):
        return {"target": target, "stage": stage, "column": column, "diff": float("nan"), "separated": False,
                "ours": a.tolist(), "other": b.tolist()}
    higher = not column.startswith("ppl")
    diff = float(a.mean() - b.mean()) if higher else float(b.mean() - a.mean())
    sep = bool(a.min() > b.max()) if higher else bool(a.max() < b.min())
    return {"target": target, "stage": stage, "column": column, "diff": diff, "separated": sep,
            "ours": a.tolist(), "other": b.tolist()}


def leads(rows: pd.DataFrame, target: float, stage: str, ours: str, other: str, column: str,
          rebalance: bool = False) -> list[float]:
    r"""``ours``'s lead over ``other`` per seed, ``log(ppl_other) - log(ppl_ours)`` (nats; > 0: ``ours`` better),
    pairing the rows of equal seed (the same training windows); one value for the deterministic (a) rows."""
    a, sa = _values(rows, ours, target, stage, column, rebalance)
    b, sb = _values(rows, other, target, stage, column, rebalance)
    pairs = {s: x for s, x in zip(sb, b)}
    return [float(np.log(pairs[s]) - np.log(x)) for s, x in zip(sa, a) if s in pairs]


def lead_change(before: float, after, tol: float = 0.01) -> dict:
    r"""How a lead (nats, :func:`leads`) changed from before training (one value) to after (one per seed).

    The noise is ``max(spread, tol)``, ``spread`` the range of the lead over seeds. With a lead before
    (``before > tol``): ``"reverses"`` (after ``< -noise``), ``"vanishes"`` (``|after| <= noise``),
    ``"grows"`` / ``"shrinks"`` (after above / below before by more than the noise), else ``"holds"``. With
    none before: ``"appears"``, ``"level"`` or ``"behind"``; ``"missing"`` without a finite lead.

    >>> [lead_change(0.10, a)["verdict"] for a in ([0.30, 0.32], [0.11, 0.09], [0.0, 0.01], [-0.2, -0.25])]
    ['grows', 'holds', 'vanishes', 'reverses']
    """
    after = np.asarray(list(after), dtype=float)
    after = after[np.isfinite(after)]  # a perplexity that overflowed has no lead
    if not len(after) or not math.isfinite(before):
        return {"before": before, "after": float("nan"), "spread": float("nan"), "verdict": "missing"}
    mean = float(after.mean())
    spread = float(after.max() - after.min()) if len(after) > 1 else 0.0
    noise = max(spread, tol)
    if before <= tol:
        verdict = "appears" if mean > noise else "behind" if mean < -noise else "level"
    elif mean < -noise:
        verdict = "reverses"
    elif abs(mean) <= noise:
        verdict = "vanishes"
    elif mean - before > noise:
        verdict = "grows"
    elif before - mean > noise:
        verdict = "shrinks"
    else:
        verdict = "holds"
    return {"before": float(before), "after": mean, "spread": spread, "noise": noise, "verdict": verdict}


def standing(changes: pd.DataFrame, tol: float = 0.01) -> dict[str, dict[str, int]]:
    r"""Per other method, in how many (ratio, text, stage) comparisons ``ours`` is behind, level or ahead.

    ``changes``: the :func:`lead_change` records with their ``other``, ``target``, ``text`` and ``stage``; each
    (ratio, text) contributes its lead before training (stage (a), once; deterministic, so its noise is ``tol``)
    and its mean lead after each trained stage, whose noise is the record's ``max(seed spread, tol)`` as in
    :func:`lead_change`. Behind: a lead below minus the noise; ahead: above it; level between.

    >>> ch = pd.DataFrame({"other": ["x", "x"], "target": [0.2, 0.2], "text": ["ppl_ptb"] * 2,
    ...                    "stage": ["dobi", "lora"], "before": [-0.3, -0.3], "after": [-0.1, -0.03],
    ...                    "noise": [0.02, 0.05]})
    >>> standing(ch)  # (a) -0.3 and (b) -0.1 behind; (c) -0.03 within its seed spread 0.05
    {'x': {'behind': 2, 'level': 1, 'ahead': 0, 'of': 3}}
    """
    out = {}
    for other, g in changes.groupby("other", sort=False):
        first = g.drop_duplicates(["target", "text"])
        after_noise = g["noise"] if "noise" in g else pd.Series(tol, index=g.index)
        lead = np.array([*first["before"], *g["after"]], dtype=float)
        noise = np.array([*[tol] * len(first), *after_noise.fillna(tol)], dtype=float)
        keep = np.isfinite(lead)
        lead, noise = lead[keep], noise[keep]
        out[other] = {"behind": int((lead < -noise).sum()), "level": int((abs(lead) <= noise).sum()),
                      "ahead": int((lead > noise).sum()), "of": int(len(lead))}
    return out


def rebalance_effect(rows: pd.DataFrame, method: str, target: float, column: str, tol: float = 0.01) -> dict:
    r"""Does rebalancing the factors before LoRA help? Per seed ``log(ppl_plain) - log(ppl_rebalanced)`` (> 0:
    it helps); ``"helps"`` / ``"hurts"`` when the mean lies beyond ``max(spread, tol)`` of zero, else
    ``"no measurable difference"``."""
    plain, sp = _values(rows, method, target, "lora", column, False)
    reb, sr = _values(rows, method, target, "lora", column, True)
    pairs = {s: x for s, x in zip(sr, reb)}
    d = np.array([np.log(x) - np.log(pairs[s]) for s, x in zip(sp, plain) if s in pairs], dtype=float)
    d = d[np.isfinite(d)]
    if not len(d):
        return {"method": method, "target": target, "column": column, "verdict": "missing"}
    mean = float(d.mean())
    spread = float(d.max() - d.min()) if len(d) > 1 else 0.0
    noise = max(spread, tol)
    verdict = "helps" if mean > noise else "hurts" if mean < -noise else "no measurable difference"
    return {"method": method, "target": target, "column": column, "gain": mean, "per_seed": d.tolist(),
            "spread": spread, "verdict": verdict}


def all_collapsed(rows: pd.DataFrame, dense: dict, target: float, multiple: float) -> bool:
    """True when every row at ``target`` has a PTB or Wikipedia perplexity above ``multiple`` x the dense model's
    (the condition for adding the gentler fallback ratio)."""
    sub = rows[np.isclose(rows["target"].astype(float), target)]
    if sub.empty:
        return False
    worst = np.maximum(sub["ppl_ptb"].to_numpy(float) / dense["ppl_ptb"],
                       sub["ppl_wiki"].to_numpy(float) / dense["ppl_wiki"])
    return bool(np.all(~np.isfinite(worst) | (worst > multiple)))


def training_curves(records: list[dict]) -> pd.DataFrame:
    """One row per (trained row, step) from the held-out records of :func:`run_rows`: ``phase``
    (``"truncation"``: ``lm`` term, soft ``ratio``; ``"recovery"``: ``loss``), method, target, seed, rebalance."""
    out = []
    for rec in records:
        if rec["stage"] == "allocated":
            continue
        phase = "truncation" if rec["stage"] == "dobi" else "recovery"
        for h in rec["heldout"].get("history") or []:
            out.append({"phase": phase, "method": rec["method"], "target": rec["target"], "seed": rec["seed"],
                        "rebalance": rec["rebalance"], "step": h["step"], "loss": h.get("loss"),
                        "lm": h.get("lm"), "soft_ratio": h.get("ratio"), "lr": h.get("lr")})
    return pd.DataFrame(out)
