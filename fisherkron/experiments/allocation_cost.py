"""The allocation study: quality against cost of five rank allocations at k = 32.

Used only by ``notebooks/fig_allocation_cost.py``. It reuses the decoder study's protocol and caches
(:mod:`fisherkron.experiments.llm_compression`: the same k = 32 SmolLM2 calibration entry, the same sweep
batches, so ASVD's sensitivity sweeps are shared with ``tab_llm_compression_*``, and every scored case is
cached by its full configuration). Each method is compressed at each whole-model ratio with

* ``uniform``: every layer at the same per-layer ratio (no evaluation);
* ``fisher``: Theorem 1's curves ``0.5 sum_{i>r} s~_i^2`` in the method's own Fisher metric, one scale for
  all layers (no evaluation);
* ``sensitivity``: ASVD's sweep, the paper's protocol (6 candidates x every layer);
* ``calibrated`` / ``calibrated_kl``: the fisher curves, each scaled through one measured point per layer
  (held-out loss increase / KL divergence from the dense outputs), ranks from the exact integer program;
* ``lems``: LEMS's allocation reimplemented (energy shape, one KL point at 10 % of the rank, depth bias).

:func:`cost` says what each allocation spent (model evaluations, seconds), :func:`predictions` puts each
case's predicted loss increase (raw and calibrated curves) beside the measured one, and :func:`target`
checks the study's target from the numbers; :func:`head_to_head` says which of two allocations is better.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.conventions import FisherkronError

__all__ = ["ALLOCATIONS", "STRATEGY_KIND", "run_grid", "cost", "predictions", "spearman", "target", "head_to_head"]

#: the allocations of the study, in the order of the tables and figures
ALLOCATIONS = ("uniform", "fisher", "sensitivity", "lems", "calibrated", "calibrated_kl")
#: how each allocation spends model evaluations: none, a sweep over candidates, or one point per layer
STRATEGY_KIND = {"uniform": "free", "fisher": "free", "sensitivity": "sweep", "lems": "one point",
                 "calibrated": "one point", "calibrated_kl": "one point"}


def run_grid(study, methods, allocations, ratios, *, progress: bool = True) -> list[dict]:
    """One row per (method, allocation, ratio) that the allocation can reach: the held-out selection loss,
    the perplexities and what the allocation cost (:func:`cost`). Work runs method by method, so each
    method's weighted SVDs are computed once; an allocation a method does not support (``allocations`` maps a
    method to its list) is skipped. Every score comes from, or goes to, the study's case cache."""
    from tqdm.auto import tqdm

    from .llm_compression import Case
    from .llm_summary import flatten

    jobs = [(m, a, t) for m in methods for a in allocations.get(m, ()) for t in ratios]
    rows = []
    for method, allocation, target in tqdm(jobs, desc="cases (method x allocation x ratio)", disable=not progress):
        if not study.feasible(allocation, target):
            continue
        if allocation == "sensitivity":
            study.sweep(method, progress=progress)
        got = study.scores(Case(method, allocation, target), ("heldout", "ppl"))
        held = got["heldout"]
        rows.append({"method": method, "allocation": allocation, "target": target, **flatten(got),
                     **cost(allocation, held), "ranks": held.get("ranks", {}),
                     "predicted": held.get("predicted"), "scales": held.get("scales")})
    return rows


def cost(allocation: str, held: dict) -> dict:
    """What ``allocation`` spent to choose its ranks: model ``evaluations`` (a held-out loss or KL of the model
    with one layer compressed, plus the dense reference) and their ``seconds`` as first measured (a sweep read
    back from the cache reports the seconds it took when it ran). The free allocations spend none.

    >>> cost("uniform", {})
    {'evaluations': 0, 'seconds': 0.0, 'kind': 'free'}
    """
    if allocation not in STRATEGY_KIND:
        raise FisherkronError(f"allocation {allocation!r} is not one of the study's {', '.join(STRATEGY_KIND)}")
    kind = STRATEGY_KIND[allocation]
    if kind == "free":
        return {"evaluations": 0, "seconds": 0.0, "kind": kind}
    ev = int(held.get("allocation_evaluations") or 0)
    if ev <= 0:
        raise FisherkronError(f"the {allocation} case records no evaluations; its cached record predates the "
                              "cost bookkeeping: delete it from the study cache to measure it again")
    return {"evaluations": ev, "seconds": float(held.get("sweep_seconds") or 0.0), "kind": kind}


def predictions(rows: list[dict], curves: dict, dense_loss: float, *, scales: dict | None = None) -> list[dict]:
    """Predicted against measured held-out loss increase of whole allocations.

    ``curves[layer][r]``: Theorem 1's ``0.5 sum_{i>r} s~_i^2`` of one method (``fisher_curves``);
    ``scales[layer]``: the calibrated allocation's per-layer factors (``None``: raw curves only). A layer
    kept dense (rank ``None``) predicts 0. Returns one dict per row with ``predicted_raw``,
    ``predicted_calibrated`` (``nan`` without scales) and ``measured`` = its held-out loss - ``dense_loss``.
    """
    out = []
    for row in rows:
        raw = cal = 0.0
        for name, r in row["ranks"].items():
            if r is None:
                continue
            e = float(curves[name][int(r)])
            raw += e
            cal += e * float(scales[name]) if scales else 0.0
        out.append({"method": row["method"], "allocation": row["allocation"], "target": row["target"],
                    "predicted_raw": raw, "predicted_calibrated": cal if scales else float("nan"),
                    "measured": row["loss"] - dense_loss})
    return out


def spearman(x, y) -> float:
    """Spearman's rank correlation of two sequences (``nan`` with fewer than 3 finite pairs)."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3:
        return float("nan")
    return float(spearmanr(x[ok], y[ok])[0])


def find_row(rows: list[dict], method: str, allocation: str, ratio: float) -> dict | None:
    """The first row of ``rows`` for (``method``, ``allocation``, target ``ratio``), or ``None`` where that case
    did not run (an unreachable ratio). Target ratios compare with ``math.isclose``, so 0.1 finds 0.1000000001.

    >>> find_row([{"method": "m", "allocation": "a", "target": 0.1}], "m", "a", 0.1 + 1e-12)["allocation"]
    'a'
    """
    for r in rows:
        if r["method"] == method and r["allocation"] == allocation and math.isclose(r["target"], ratio):
            return r
    return None


def target(rows: list[dict], methods, ratios, *, metric: str = "ppl_ptb", calibrated: str = "calibrated",
           eval_share: float = 1 / 3) -> dict:
    """The study's target, per method and ratio: the ``calibrated`` allocation's ``metric`` at most the better of
    the sensitivity sweep's and the fisher allocation's, with at most ``eval_share`` of the sweep's evaluations,
    and ahead of LEMS. Each check is ``None`` where a row it needs is missing (an unreachable ratio).

    Returns ``{method: {ratio: {"met": bool | None, "quality": ..., "cost": ..., "beats_lems": ..., numbers}}}``.
    """
    out: dict = {}
    for m in methods:
        for t in ratios:
            c, s, f, le = (find_row(rows, m, a, t) for a in (calibrated, "sensitivity", "fisher", "lems"))
            rec: dict = {"calibrated": c[metric] if c else None}
            refs = [x[metric] for x in (s, f) if x is not None]
            rec["better_of_sweep_fisher"] = min(refs) if refs else None
            rec["quality"] = None if c is None or not refs else bool(c[metric] <= min(refs))
            rec["cost"] = None if c is None or s is None else bool(c["evaluations"] <= eval_share * s["evaluations"])
            rec["evaluations"] = (c["evaluations"] if c else None, s["evaluations"] if s else None)
            rec["lems"] = le[metric] if le else None
            rec["beats_lems"] = None if c is None or le is None else bool(c[metric] < le[metric])
            checks = [rec[k] for k in ("quality", "cost", "beats_lems")]
            rec["met"] = None if any(v is None for v in checks) else all(checks)
            if c is not None and refs:
                rec["shortfall"] = c[metric] / min(refs) - 1.0  # > 0: by how much it falls short
            out.setdefault(m, {})[t] = rec
    return out


def head_to_head(rows: list[dict], a: str, b: str, methods, ratios, *, metric: str = "ppl_ptb") -> dict:
    """Allocation ``a`` against ``b`` over every (method, ratio) that both reached: ``wins`` of each (lower
    ``metric`` wins; equal values are ``ties``), ``pairs``, and ``geomean``, the geometric mean of ``a``'s
    metric over ``b``'s (below 1: ``a`` is better on the whole; ``nan`` with no pair).

    >>> r = [{"method": "m", "allocation": x, "target": 0.1, "ppl_ptb": p} for x, p in (("a", 10.0), ("b", 40.0))]
    >>> head_to_head(r, "a", "b", ["m"], [0.1])
    {'wins': {'a': 1, 'b': 0}, 'ties': 0, 'pairs': 1, 'geomean': 0.25}
    """
    def get(m, x, t):
        row = find_row(rows, m, x, t)
        return row[metric] if row else None

    wins, ties, logs = {a: 0, b: 0}, 0, []
    for m in methods:
        for t in ratios:
            va, vb = get(m, a, t), get(m, b, t)
            if va is None or vb is None:
                continue
            logs.append(math.log(va / vb))
            if va == vb:
                ties += 1
            else:
                wins[a if va < vb else b] += 1
    return {"wins": wins, "ties": ties, "pairs": len(logs),
            "geomean": float(math.exp(sum(logs) / len(logs))) if logs else float("nan")}
