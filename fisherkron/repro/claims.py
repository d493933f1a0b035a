"""The paper's 19 figures and tables, and the scale study beyond it: what each claims, the paper's number, ours,
and a verdict.

Every item (:data:`ITEMS`, in the paper's order and grouping) names the notebook whose page shows
it and an extractor ``ours(records) -> (our number, verdict)`` that reads the committed records in
``figures/`` (:func:`load_records`) and computes the verdict by the rule in its docstring. The
paper's numbers are quotations of the paper; ours are read from the records, never typed.

* :data:`VERDICTS`: *holds* (as the paper says), *holds in part* (in some settings), *not at this
  scale* (the mechanism is there, the paper's effect does not appear on our small models),
  *cannot tell* (our evaluation cannot separate the rows, or a record lacks what the item needs),
  *does not hold* (the opposite was measured);
* :func:`results`: one row per item; :func:`results_table`: the rows as a Markdown table
  (the README's and the book's).
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import FisherkronError
from ..env import REPO_ROOT, json_object, read_committed, shown

__all__ = ["VERDICTS", "Item", "ITEMS", "PAPER_ITEMS", "BEYOND", "load_records", "results", "table_cell", "results_table"]

VERDICTS = ("holds", "holds in part", "not at this scale", "cannot tell", "does not hold")
Records = dict[str, dict[str, Any]]
#: where the teaching notebook's status is put into the records when it writes no summary record
TEACHING = "executed/kronecker_fisher_from_scratch"
RIVALS = {"fwsvd": "FWSVD", "asvd": "ASVD", "svd_llm": "SVD-LLM", "basis_sharing": "Basis Sharing"}


@dataclass(frozen=True)
class Item:
    """One figure or table of the paper, and how its verdict is computed from our records."""

    label: str  # the paper's \\label, e.g. "tab:glue_results"
    group: str  # the paper's section, e.g. "Encoder compression (Sec. 6.2, App. G)"
    claim: str  # what the paper claims with it, one line
    paper: str  # the paper's number for it, quoted from the paper
    notebook: str  # the notebook whose page shows it
    ours: Callable[[Records], tuple[str, str]]  # records -> (our number, verdict)

    @property
    def title(self) -> str:
        """``"fig:time_algo"`` -> ``"Fig. time_algo"``."""
        kind, name = self.label.split(":", 1)
        return f"{kind.capitalize()}. {name}"

    @property
    def rule(self) -> str:
        """The verdict rule: the first paragraph of the extractor's docstring."""
        return " ".join((self.ours.__doc__ or "").strip().split("\n\n")[0].split())


# ---------------------------------------------------------------------------------------- helpers

def _count(hits: int, total: int) -> str:
    """All of ``total`` cases: holds; some: holds in part; none: does not hold; no case: cannot tell."""
    if total == 0:
        return "cannot tell"
    return "holds" if hits == total else "holds in part" if hits else "does not hold"


def _given(verdict: Any) -> str:
    """A verdict a summary record computed, if it is one of :data:`VERDICTS`."""
    return verdict if verdict in VERDICTS else "cannot tell"


def _num(cell: Any, spread: bool = False) -> float:
    """A table cell as a number: ``"0.425 ± 0.011"`` -> 0.425 (``spread``: 0.011, 0 without ``±``),
    ``"**13,801**"`` -> 13801, ``"50%"`` -> 50."""
    parts = str(cell).replace("*", "").replace(",", "").replace("%", "").split("±")
    return (float(parts[1]) if len(parts) > 1 else 0.0) if spread else float(parts[0])


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _plain(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """A speed table's rows at a compressed ratio, as asked (no 0 %, no "keep dense" variant)."""
    return [dict(r, ratio=_pct(_num(r["target ratio"]) / 100)) for r in rows
            if "keep" not in r["target ratio"] and _num(r["target ratio"]) > 0]


# ------------------------------------------------------------------------------- Method (Secs. 4-5)

def _connection2fwsvd(records: Records) -> tuple[str, str]:
    """The teaching notebook's summary record: all of its named checks true: holds (some: holds in
    part, none: does not hold; a verdict of :data:`VERDICTS` as it is). Without one: its committed
    executed notebook without an error output: holds; no executed notebook: cannot tell."""
    params = records["fig_connection2fwsvd"]["parameters"]
    layer = f"{params['n']} x {params['m']}"
    if "kronecker_fisher_from_scratch_summary" in records:
        checks = records["kronecker_fisher_from_scratch_summary"]["extra"]["verdict"]
        if not isinstance(checks, dict):
            return f"checked on a {layer} layer (float64)", _given(checks)
        hits = sum(bool(v) for v in checks.values())
        return f"{hits} of {len(checks)} checks exact on a {layer} layer (float64)", _count(hits, len(checks))
    run = records.get(TEACHING)
    if run is None:
        return "no summary record, no executed notebook", "cannot tell"
    if run["errors"]:
        return f"{run['errors']} error output(s) in the executed notebook", "does not hold"
    return f"checked exactly on a {layer} layer (float64)", "holds"


def _fig_time_algo(records: Records) -> tuple[str, str]:
    """Every layer of the sweep converged and MFF's products run at a median of at least half the
    GEMM peak measured in the same run (time follows Eq. (12)'s flop count): holds; converged
    but slower: holds in part; a layer that did not converge: does not hold."""
    rows = records["tab_time_algo_sweep"]["table"]
    if not rows:
        return "no sweep rows", "cannot tell"
    share = statistics.median(_num(r["ours_gflops"]) for r in rows) / _num(rows[0]["peak_gflops"])
    big = max((r for r in rows if r["sweep"] == "size"), key=lambda r: _num(r["params_in_layer"]))
    ours = (f"{_num(big['ours_s']):.1f} s for {big['n']} x {big['m']} (k = {big['k']}); products at "
            f"{_pct(share)} of the GEMM peak")
    if not all(r["ours_converged"] == "True" for r in rows):
        return ours, "does not hold"
    return ours, "holds" if share >= 0.5 else "holds in part"


def _tab_time_algo(records: Records) -> tuple[str, str]:
    """Rows timed here (not extrapolated) within 10x of the paper's GPU seconds (the notebook
    compares orders of magnitude): all rows timed: holds; some timed, the others extrapolated:
    holds in part; a timed row beyond 10x: does not hold; none timed: cannot tell."""
    record = records["tab_time_algo"]
    rows = record["table"]
    timed = [r for r in rows if r["how"].startswith("measured")]
    llama = next(r for r in rows if r["model"].startswith("Llama-2-7B"))
    done = ", ".join(f"{r['model']} {_num(r['seconds (ours)']):.0f} s" for r in timed) or "none"
    how = llama["how"].split(" ")[0]
    ours = (f"{done} timed, {llama['model']} {_num(llama['seconds (ours)']):.0f} s {how}, on "
            f"{record['machine']['cpu_count']} CPU cores")
    if not timed:
        return ours, "cannot tell"
    if any(_num(r["seconds (ours)"]) > 10 * _num(r["paper GPU seconds"]) for r in timed):
        return ours, "does not hold"
    return ours, "holds" if len(timed) == len(rows) else "holds in part"


PAPER_GAP = (74, 224)  # Fig. singular_values: layers with sigma_1/sigma_2 > 3 in Llama-2-7B-chat
GAP_TOL = 0.10  # a fraction of the layers within 10 points of the paper's third tells the same story


def _singular_values(records: Records) -> tuple[str, str]:
    """SmolLM2's fraction of layers with sigma_1/sigma_2 > 3 within 10 points of the paper's
    74/224, and layers where one Kronecker term holds under half of ||F||^2 (the slow decay): both:
    holds; one: holds in part; neither: does not hold."""
    v = records["fig_singular_values_summary"]["extra"]["verdict"]["smollm2"]
    ours = (f"{v['gap_layers']} of {v['layers']} layers ({_pct(v['gap_fraction'])}); one term holds < half "
            f"of ||F||^2 in {v['layers_share_1_below_half']}")
    checks = [abs(v["gap_fraction"] - PAPER_GAP[0] / PAPER_GAP[1]) <= GAP_TOL, v["layers_share_1_below_half"] > 0]
    return ours, _count(sum(checks), len(checks))


# ------------------------------------------------------------------ Synthetic correlations (Sec. 6.1)

def _corr(records: Records) -> tuple[str, str]:
    """The record draws the paper's three regimes (isotropic, anisotropic, Toeplitz): holds;
    otherwise: cannot tell."""
    p = records["fig_corr"]["parameters"]
    ours = f"{', '.join(p['covariances'])}; Toeplitz rho = {p['rho']}, d = {p['d']}"
    return ours, "holds" if {"isotropic", "anisotropic", "toeplitz"} <= set(p["covariances"]) else "cannot tell"


def _diag_full_synth(records: Records) -> tuple[str, str]:
    """The synthetic study's named checks (diagonal adequate when isotropic, gap growing with
    correlation beyond two standard errors, largest for Toeplitz): all true: holds; some: holds in
    part; none: does not hold."""
    checks = records["fig_synthetic_correlations_summary"]["extra"]["claim_check"]
    gaps = {r["covariance"]: _num(r["gap"]) for r in records["tab_synthetic_gaps"]["table"] if r["versus"] == "fwsvd"}
    ours = "GFWSVD - FWSVD " + " / ".join(f"{100 * g:+.1f}" for g in gaps.values()) + \
        f" pp ({' / '.join(gaps)}, low ranks)"
    return ours, _count(sum(bool(c) for c in checks.values()), len(checks))


# ------------------------------------------------------------------- Encoder compression (Sec. 6.2)

def _bert_glue_avg(records: Records) -> tuple[str, str]:
    """The GLUE summary's verdict on "the lead over FWSVD and SVD grows at low rank"
    (``verdicts.lead_grows``: the growth beyond its standard error)."""
    v = records["tab_glue_results_summary"]["extra"]["verdicts"]["lead_grows"]
    leads = re.findall(r"vs ([\w-]+): lead ([+-]?\d+\.\d+) at r in \[[^\]]*\] -> ([+-]?\d+\.\d+)", v["text"])
    if not leads:
        raise ValueError("lead_grows.text names no lead")
    return "lead " + ", ".join(f"over {m} {a} -> {b}" for m, a, b in leads) + " (high -> low ranks)", \
        _given(v["verdict"])


def _glue_results(records: Records) -> tuple[str, str]:
    """The GLUE summary's verdict on "GFWSVD has the best macro average at each rank"
    (``verdicts.best``: best or tied within its standard error, at every rank)."""
    extra = records["tab_glue_results_summary"]["extra"]
    best, with_llm = extra["verdicts"]["best"], extra["best_with_svd_llm"]
    return (f"best or tied at {best['ranks_ok']} of {best['ranks']} ranks ({with_llm['ranks_ok']} of "
            f"{with_llm['ranks']} with SVD-LLM)", _given(best["verdict"]))


def _glue_extended(records: Records) -> tuple[str, str]:
    """At the top rank, on the tasks the uncompressed model learned, GFWSVD against FWSVD, ahead or
    behind by more than the larger seed spread: ahead on all: holds; on some: holds in part; behind
    on some and ahead on none: does not hold; level on all: cannot tell."""
    learned = records["tab_glue_results_summary"]["extra"]["learned_tasks"]
    rows = [r for r in records["tab_glue_extended"]["table"] if r["block"].startswith("r = ")]
    top = rows[0]["block"]
    by = {r["method"]: r for r in rows if r["block"] == top}
    tasks = [c for c in by["GFWSVD"] if c not in ("block", "method", "macro avg")
             and any(re.sub(r"[^a-z0-9]", "", c.split(" (")[0].lower()).startswith(t) for t in learned)]
    calls = {}
    for task in tasks:
        ours, other = by["GFWSVD"][task], by["FWSVD"][task]
        diff, noise = _num(ours) - _num(other), max(_num(ours, spread=True), _num(other, spread=True))
        calls[task.split(" (")[0]] = "ahead" if diff > noise else "behind" if diff < -noise else "level"
    text = f"{top.split(' (')[0]}, learned tasks: " + ", ".join(f"{c} on {t}" for t, c in calls.items())
    ahead, behind = sum(c == "ahead" for c in calls.values()), sum(c == "behind" for c in calls.values())
    if not ahead:
        return text, "does not hold" if behind else "cannot tell"
    return text, _count(ahead, len(calls))


# ------------------------------------------------------------------- Decoder compression (Sec. 6.3)

def _beats(records: Records, summary: str, rivals: tuple[str, ...],
           keys: tuple[str, ...] = ("beats",)) -> tuple[dict[str, int], list[float]]:
    """Per rival, at how many ratios GFWSVD wins on every one of ``keys`` (as the paper ran the
    methods), and the ratios. ``beats``: both perplexities and the accuracy."""
    pairs = [p for p in records[summary]["extra"]["verdict"]["gfwsvd_beats_paper"] if p["other"] in rivals]
    wins = {r: sum(all(p[k] for k in keys) for p in pairs if p["other"] == r) for r in rivals}
    return wins, sorted({p["target"] for p in pairs})


def _llama31(records: Records) -> tuple[str, str]:
    """GFWSVD beats (both perplexities and the mean accuracy) FWSVD, ASVD and Basis Sharing, as
    the paper ran them: at every (ratio, rival): holds; at some: holds in part; none: does not hold."""
    rivals = ("fwsvd", "asvd", "basis_sharing")
    wins, ratios = _beats(records, "tab_llm_compression_main_summary", rivals)
    ours = "beats " + ", ".join(f"{RIVALS[r]} {wins[r]}/{len(ratios)}" for r in rivals) + \
        f" ratios ({_pct(ratios[0])[:-2]}-{_pct(ratios[-1])})"
    return ours, _count(sum(wins.values()), len(rivals) * len(ratios))


def _llama2_chat(records: Records) -> tuple[str, str]:
    """GFWSVD beats SVD-LLM (the rival only this table has) at every ratio: holds; else, if the
    calibration study shows GFWSVD's gap to SVD-LLM narrowing as k grows at every ratio it
    studied: not at this scale; else some ratios: holds in part; none: does not hold."""
    wins, ratios = _beats(records, "tab_llm_compression_main_summary", ("svd_llm",))
    ours = f"beats SVD-LLM at {wins['svd_llm']} of {len(ratios)} ratios"
    if wins["svd_llm"] == len(ratios):
        return ours, "holds"
    study = {k: v for k, v in records["fig_calibration_summary"]["extra"]["verdict"].items()
             if isinstance(v, dict) and "gap_to_svd_llm_kmax" in v}
    narrows = bool(study) and all(v["gap_to_svd_llm_kmax"] < v["gap_to_svd_llm_kmin"] for v in study.values())
    if narrows:
        ks = records["fig_calibration_summary"]["parameters"]["ks"]
        gaps = ", ".join(f"{v['gap_to_svd_llm_kmin']:.2f}x -> {v['gap_to_svd_llm_kmax']:.2f}x ({_pct(float(r))})"
                         for r, v in study.items())
        return f"{ours}; PTB gap {gaps} as k grows {min(ks)} -> {max(ks)}", "not at this scale"
    return ours, _count(wins["svd_llm"], len(ratios))


# --------------------------------------------------------------------- Speed and FLOPs (App. F)

def _throughput_fwsvd(records: Records) -> tuple[str, str]:
    """Prefill tokens/s: faster than dense at every ratio and fastest at the largest: holds; faster
    at some ratios: holds in part; at none: does not hold."""
    rows = _plain(records["tab_throughput_fwsvd"]["table"])
    speed = [_num(r["speedup"]) for r in rows]
    ours = f"{speed[0]:.2f}x at {rows[0]['ratio']}, {speed[-1]:.2f}x at {rows[-1]['ratio']}"
    if all(s > 1 for s in speed) and speed[-1] == max(speed):
        return ours, "holds"
    return ours, "holds in part" if any(s > 1 for s in speed) else "does not hold"


FLOP_TOL = 0.05  # compressed / dense FLOPs within 5 points of the paper's counts as matching it


def _flops(records: Records) -> tuple[str, str]:
    """Analytic and counted FLOPs agree and fall with the ratio for every model: the mechanism;
    Llama-2-7B's compressed / dense FLOPs also within 0.05 of the paper's at every ratio: holds;
    the mechanism only: holds in part; FLOPs that do not fall: does not hold."""
    rows = records["tab_flops_comparison"]["table"]
    llama = [r for r in rows if r["paper FLOPs / dense"]]
    falls = all(_num(a["FLOPs / dense"]) > _num(b["FLOPs / dense"]) for a, b in zip(rows, rows[1:])
                if a["model"] == b["model"])
    dense, last = llama[0], llama[-1]
    ours = (f"Llama-2-7B {_num(dense['TFLOPs (analytic)']):.2f} T dense (paper {dense['paper TFLOPs']} T); "
            f"{_num(last['FLOPs / dense']):.2f} of dense at {_pct(_num(last['target ratio']))}")
    if not (falls and all(r["equal"] == "True" for r in rows)):
        return ours, "does not hold"
    match = all(abs(_num(r["FLOPs / dense"]) - _num(r["paper FLOPs / dense"])) <= FLOP_TOL for r in llama)
    return ours, "holds" if match else "holds in part"


def _throughput_forward(records: Records) -> tuple[str, str]:
    """Latency per decoded token falls at every ratio and batch: holds; if not, but FLOPs fall at
    every row and the layer timings record factorised layers slower than dense: not at this scale;
    else falls at some: holds in part; at none: does not hold."""
    rows = _plain(records["tab_throughput_forward"]["table"])
    top = rows[-1]["ratio"]
    ours = ", ".join(f"{_num(r['speedup']):.2f}x (batch {r['batch']})" for r in rows if r["ratio"] == top)
    ours = f"{top}: {ours}; FLOPs {_num(rows[-1]['FLOP speedup']):.2f}x"
    faster = sum(_num(r["speedup"]) > 1 for r in rows)
    if faster == len(rows):
        return ours, "holds"
    slower_layers = records["tab_throughput_summary"]["extra"]["verdict"]["slower_layer_cases"]
    if all(_num(r["FLOP speedup"]) > 1 for r in rows) and slower_layers > 0:
        return ours, "not at this scale"
    return ours, "holds in part" if faster else "does not hold"


# ---------------------------------------------------------- Learned truncation and LoRA (Sec. 6.4)

def _extra_compression(records: Records) -> tuple[str, str]:
    """Dobi-GFWSVD ahead of Dobi-SVD on both perplexities beyond the seed spread: at every ratio:
    holds; at some: holds in part; at none: does not hold."""
    v = records["tab_extra_compression_results_summary"]["extra"]["verdict"]
    ahead = {r: all(c[t]["separated"] and c[t]["diff"] > 0 for t in ("ppl_wiki", "ppl_ptb"))
             for r, c in v["dobi_gfwsvd_ahead"].items()}
    show = "0.2" if "0.2" in ahead else next(iter(ahead))
    ptb = v["dobi_gfwsvd_ahead"][show]["ppl_ptb"]
    ours = (f"ahead at {sum(ahead.values())} of {len(ahead)} ratios; {_pct(float(show))}: PTB "
            f"{statistics.mean(ptb['ours']):.0f} vs {statistics.mean(ptb['other']):.0f} "
            f"(dense {v['dense']['ppl_ptb']:.0f})")
    return ours, _count(sum(ahead.values()), len(ahead))


# ---------------------------------------------------------------- Ablations and MMLU (Apps. H-I)

def _ablation(records: Records) -> tuple[str, str]:
    """The ordering FWSVD > Diag > Non-diag > Full (perplexity) in every (ratio, text) case: holds;
    in some: holds in part; in none: does not hold."""
    cases = records["tab_ablation_diag_summary"]["extra"]["verdict"]["ordering"]["cases"]
    hits = sum(bool(c["holds"]) for c in cases.values())
    name = next((c for c in cases if c.endswith("ptb")), next(iter(cases)))
    ours = f"order in {hits} of {len(cases)} cases; {name}: " + " > ".join(f"{p:.4g}" for p in cases[name]["ppl"])
    return ours, _count(hits, len(cases))


# ---------------------------------------------------------------- Beyond the paper

def _scale(records: Records) -> tuple[str, str]:
    """GFWSVD's log-perplexity gap to its best rival (SVD-LLM or KFAC-SVD) smaller on the largest decoder than on
    the smallest by more than two standard errors: at every ratio: holds; at some: holds in part; larger at any
    ratio by more than two: does not hold; else (the sizes cannot tell): cannot tell."""
    v = records["fig_scale_summary"]["extra"]["verdict"]
    trends = [t for k, t in sorted(v.items()) if k.startswith("trend_") and t.get("models", 0) > 1]
    if not trends:
        return "one model: no trend", "cannot tell"
    last = trends[-1]
    shrink = [e for e in v.get("shrinkage", []) if e["model"] == last["largest"]]
    cut = (f" at a matched cut ({100 * last['reference_share']:.0f} % of the block linears removed)"
           if "reference_share" in last else "")
    ours = (f"gap{cut} {last['gap_smallest']:+.2f} ({last['smallest']}) -> {last['gap_largest']:+.2f} "
            f"({last['largest']}), change {last['change']:+.2f} ± {last['se']:.2f}")
    if shrink:
        e = shrink[-1]
        ours += (f"; shrinkage {e['shrunk_vs_plain']:+.2f} ± {e['se']:.2f} on {last['largest']} "
                 f"at {100 * e['target']:g} %" + (f" ({e['allocation']} ranks)" if e.get("allocation") else ""))
    if any(t["grows"] for t in trends):
        return ours, "does not hold"
    hits = sum(t["shrinks"] for t in trends)
    return ours, ("cannot tell" if hits == 0 else _count(hits, len(trends)))


def _at_chance(v: dict[str, Any], rows: list) -> bool:
    """MMLU cannot tell: the dense model, or every compressed row, within chance's error bars."""
    return bool(v["dense_at_chance"]) or len(v["at_chance"]) >= len(rows)


def _mmlu_verdict(records: Records, rivals: tuple[str, ...]) -> tuple[str, str]:
    """The MMLU tables: GFWSVD against ``rivals`` on both perplexities, and with MMLU."""
    name = "tab_llm_compression_mmlu_summary"
    v, rows = records[name]["extra"]["verdict"], records[name]["extra"]["rows"]
    ppl = sum(_beats(records, name, rivals, ("ppl_ptb", "ppl_wiki"))[0].values())
    wins, ratios = _beats(records, name, rivals)
    n = len(rivals) * len(ratios)
    ours = f"perplexities won in {ppl} of {n} " + ("(ratio, rival) pairs" if len(rivals) > 1 else "ratios")
    if _at_chance(v, rows):
        dense = v["dense"]
        return f"{ours}; MMLU at chance (dense {dense['mmlu_average']:.2f} ± {dense['mmlu_average_se']:.2f})", \
            "cannot tell"
    return f"{ours}, {sum(wins.values())} with MMLU", _count(sum(wins.values()), n)


def _llama2_mmlu(records: Records) -> tuple[str, str]:
    """MMLU unable to tell the dense model or every row from chance: cannot tell; else GFWSVD beats
    FWSVD, ASVD and SVD-LLM on both perplexities and MMLU: at every (ratio, rival): holds; at some:
    holds in part; at none: does not hold."""
    return _mmlu_verdict(records, ("fwsvd", "asvd", "svd_llm"))


def _llama3_mmlu(records: Records) -> tuple[str, str]:
    """As Tab. Llama2_compression, against ASVD alone (the one rival of the Llama-3.1 table)."""
    return _mmlu_verdict(records, ("asvd",))


def _mmlu_avg(records: Records) -> tuple[str, str]:
    """MMLU unable to tell the dense model or every row from chance: cannot tell; else GFWSVD's MMLU
    lead over FWSVD and over ASVD larger at the largest ratio than at the smallest beyond two
    standard errors: both: holds; one: holds in part; neither: does not hold."""
    extra = records["tab_llm_compression_mmlu_summary"]["extra"]
    v, ratios = extra["verdict"], records["tab_llm_compression_mmlu_summary"]["parameters"]["ratios"]
    lead = v["lead_over"]["fwsvd"]
    if not lead:  # the compressed rows were not scored: the dense model itself is at chance
        dense = v["dense"]
        return (f"rows not scored: the dense model is at chance ({dense['mmlu_average']:.2f} ± "
                f"{dense['mmlu_average_se']:.2f})"), "cannot tell"
    ours = (f"lead over FWSVD {lead[0]:+.3f} at {_pct(ratios[0])}, {lead[-1]:+.3f} at {_pct(ratios[-1])}; "
            f"{len(v['at_chance'])} of {len(extra['rows'])} rows at chance")
    if _at_chance(v, extra["rows"]):
        return ours, "cannot tell"
    grows = [v["lead_over"][r][-1] > v["lead_over"][r][0] and v["lead_change"][r]["beyond_2se"]
             for r in ("fwsvd", "asvd")]
    return ours, _count(sum(grows), len(grows))


# ------------------------------------------------------------------------------------------ items

METHOD, SYNTH, ENC = "Method (Secs. 4-5)", "Synthetic correlations (Sec. 6.1)", "Encoder compression (Sec. 6.2, App. G)"
DEC, SPEED = "Decoder compression (Sec. 6.3)", "Speed and FLOPs (Sec. 6.3, App. F)"
TRAIN, APP = "Learned truncation and LoRA (Sec. 6.4)", "Ablations and MMLU (Apps. H-I)"
BEYOND = "Beyond the paper (model size)"

#: the paper's 19 figures and tables, in the paper's order by group, then the scale study
ITEMS: tuple[Item, ...] = (
    Item("fig:connection2fwsvd", METHOD, "SVD, FWSVD, GFWSVD are one weighted SVD; FWSVD is GFWSVD with a "
         "diagonal and an identity factor", "identity pair (SVD), diagonal + identity (FWSVD), two full "
         "factors (GFWSVD)", "kronecker_fisher_from_scratch", _connection2fwsvd),
    Item("fig:time_algo", METHOD, "MFF's products cost O(mn^2 + m^2n): two GEMMs, never the Fisher",
         "runtime against layer size, on a GPU", "fig_time_algo", _fig_time_algo),
    Item("tab:time_algo", METHOD, "MFF factorises a layer of a 7-13B model in minutes",
         "183 s for a Llama-2-7B layer, 43 s for BERT's (GPU)", "fig_time_algo", _tab_time_algo),
    Item("fig:singular_values", METHOD, "One Kronecker term dominates in a third of the layers; elsewhere "
         "the spectrum decays slowly", "74 of 224 layers (33 %) with sigma1/sigma2 > 3", "fig_singular_values",
         _singular_values),
    Item("fig:corr", SYNTH, "Three input regimes of growing correlation",
         "Sigma = I; a random transform; Sigma_ij = rho^|i-j|", "fig_synthetic_correlations", _corr),
    Item("fig:diag_full_synth", SYNTH, "A diagonal Fisher suffices for isotropic inputs; GFWSVD's lead grows "
         "with correlation, most for Toeplitz", "gap most pronounced for Toeplitz, none when isotropic",
         "fig_synthetic_correlations", _diag_full_synth),
    Item("fig:bert_glue_avg", ENC, "GFWSVD's gain over FWSVD and SVD is largest at low rank",
         "rank 1: GFWSVD 0.51, FWSVD 0.38, SVD 0.37", "tab_glue_results", _bert_glue_avg),
    Item("tab:glue_results", ENC, "GFWSVD has the best GLUE macro average at every rank",
         "best at 7 of 7 ranks (600 ... 1)", "tab_glue_results", _glue_results),
    Item("tab:glue_extended", ENC, "GFWSVD ahead of FWSVD on every task at the top rank",
         "r = 600: ahead or equal on 8 of 8 tasks", "tab_glue_results", _glue_extended),
    Item("tab:Llama31_compression_50", DEC, "GFWSVD beats FWSVD, ASVD and Basis Sharing at 20-50 %",
         "50 %: WT2 176 vs Basis Sharing 203, ASVD 4039, FWSVD 18992", "tab_llm_compression_main", _llama31),
    Item("tab:Llama2_chat_compression_50", DEC, "GFWSVD also beats the activation-based SVD-LLM at 20-50 %",
         "WT2 11.1 vs 12.10 at 20 %, 37.80 vs 56.72 at 50 %", "tab_llm_compression_main", _llama2_chat),
    Item("tab:throughput_fwsvd", SPEED, "A compressed model runs faster, more so the more is removed",
         "1.07x at 10 %, 1.34x at 50 % (A100, 1,024 tokens)", "tab_throughput", _throughput_fwsvd),
    Item("tab:flops_comparison", SPEED, "Factorised layers cut the forward pass's FLOPs",
         "Llama-2-7B 53.05 T dense, 29.37 T (0.55) at 50 %", "tab_throughput", _flops),
    Item("tab:throughput_forward", SPEED, "GFWSVD's latency per token falls with the ratio",
         "50 %: 3.2 -> 2.15 ms (batch 16), 4.7 -> 2.95 ms (batch 64)", "tab_throughput", _throughput_forward),
    Item("tab:extra-compression-results", TRAIN, "Dobi-GFWSVD ahead of Dobi-SVD at 20 % and 40 %",
         "40 %: WT2 10.29 vs 10.56, PTB 38.56 vs 41.70", "tab_extra_compression_results", _extra_compression),
    Item("tab:ablation_diag_results", APP, "Perplexity: FWSVD > Diag > Non-diag > Full GFWSVD",
         "10 % PTB: 96.62 > 45.26 > 37.25 > 36.44", "tab_ablation_diag", _ablation),
    Item("tab:Llama2_compression", APP, "GFWSVD beats FWSVD, ASVD, SVD-LLM at 5-20 % (perplexity, MMLU)",
         "20 %: PTB 50.50 vs 98.91 (SVD-LLM); MMLU 0.32 vs 0.29", "tab_llm_compression_mmlu", _llama2_mmlu),
    Item("tab:Llama3_compression", APP, "On Llama-3.1-8B GFWSVD beats ASVD at 10-20 % (perplexity, MMLU)",
         "10 %: MMLU 0.54 vs 0.39", "tab_llm_compression_mmlu", _llama3_mmlu),
    Item("fig:mmlu_avg", APP, "GFWSVD's MMLU lead over FWSVD and ASVD grows with compression",
         "lead over FWSVD 0.00 at 5 %, 0.05 at 20 %", "tab_llm_compression_mmlu", _mmlu_avg),
    Item("fig:scale", BEYOND, "GFWSVD's gap to SVD-LLM and KFAC-SVD (log perplexity) shrinks as the decoder grows "
         "(SmolLM2-135M, Gemma 3 270M, Qwen2.5-0.5B)", "GFWSVD ahead of SVD-LLM on Llama-2-7B and Llama-3.1-8B",
         "fig_scale", _scale),
)

#: the paper's own items (the scale study is beyond the paper)
PAPER_ITEMS: tuple[Item, ...] = tuple(item for item in ITEMS if item.group != BEYOND)

# -------------------------------------------------------------------------------- records, results

def load_records(figures: Path) -> Records:
    """Every ``*.provenance.json`` in ``figures``, by name (``tab_x`` for ``tab_x.provenance.json``).

    A record whose table ``<name>.csv`` is there carries its rows (dicts of strings) under
    ``"table"``. A file that is not a JSON object, or a table that cannot be read, raises a
    one-line :class:`FisherkronError` naming it.
    """
    from .figures import read_provenance, read_table  # the provenance layout, its fields' kinds checked

    records: Records = {}
    for path in sorted(Path(figures).glob("*.provenance.json")):
        # an empty, binary, cut-short or hand-edited file: one line naming it and what to do
        record = read_provenance(path)
        name = path.name[: -len(".provenance.json")]
        table = path.with_name(f"{name}.csv")
        if table.is_file():
            record["table"] = read_table(table, notebook=record.get("notebook"))
        records[name] = record
    return records


class _Reads(dict):
    """The records, noting which an item read: a failing item names the files behind them."""

    def __init__(self, records: Records):
        super().__init__(records)
        self.read: list[str] = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)


def _executed_status(notebook: Path) -> dict[str, int] | None:
    """A committed executed notebook's cells and error outputs (None when there is none)."""
    if not notebook.is_file():
        return None
    cells = read_committed(notebook, json_object({"cells": "list"}), what="an executed notebook (JSON)",
                           remake=f"re-run `make {notebook.stem}`")["cells"]
    errors = sum(o.get("output_type") == "error" for c in cells for o in c.get("outputs", []))
    return {"cells": len(cells), "errors": errors}


def _is_record_name(key: str) -> bool:
    """A record's name (a figure's, a table's, a summary's), not a field inside one."""
    return key.startswith(("fig_", "tab_", "bench/", "kronecker_fisher_from_scratch")) or key.endswith("_summary")


def _unreadable(item: Item, figures: Path, read: list[str], exc: Exception) -> FisherkronError:
    """A committed record that lacks, or holds in another form, what an item reads: damaged or hand-edited."""
    files = [f"{shown(Path(figures) / name)}.{ext}" for name in dict.fromkeys(read) if _is_record_name(name)
             for ext in ("provenance.json", "csv") if (Path(figures) / f"{name}.{ext}").is_file()]
    where = ", ".join(files) or shown(figures)
    return FisherkronError(
        f"{item.title}: {where} lack what this item reads ({type(exc).__name__}: {exc}): if edited by hand or "
        f"damaged, restore them from git (`git checkout -- {where.split(', ')[0]}`) or re-run the notebook "
        f"(`make {item.notebook}`)")


def results(figures: Path = REPO_ROOT / "figures") -> list[dict[str, str]]:
    """One row per item of :data:`ITEMS`: label, title, group, claim, paper, ours, verdict, notebook.

    The teaching notebook writes no summary record yet; its committed executed notebook
    (``notebooks/executed/`` beside ``figures``) stands in for it under the key :data:`TEACHING`.
    An item whose notebook has not written its record yet is "cannot tell"; a record present but lacking
    what the item reads (hand-edited, damaged) is a one-line error naming the notebook.
    """
    records = load_records(figures)
    status = _executed_status(Path(figures).parent / "notebooks" / "executed" / "kronecker_fisher_from_scratch.ipynb")
    if status is not None:
        records[TEACHING] = status
    rows = []
    for item in ITEMS:
        seen = _Reads(records)
        try:
            ours, verdict = item.ours(seen)
        except KeyError as exc:
            key = exc.args[0] if exc.args else None
            if isinstance(key, str) and key not in records and _is_record_name(key) \
                    and not (Path(figures) / f"{key}.provenance.json").exists():  # the notebook has not run yet
                ours, verdict = f"not run yet (no {exc.args[0]} record)", "cannot tell"
            else:
                raise _unreadable(item, figures, seen.read, exc) from exc
        except (IndexError, TypeError, ValueError, ZeroDivisionError, StopIteration) as exc:
            raise _unreadable(item, figures, seen.read, exc) from exc
        if verdict not in VERDICTS:
            raise FisherkronError(f"{item.label}: verdict {verdict!r} is not one of {VERDICTS}")
        rows.append(dict(label=item.label, title=item.title, group=item.group, claim=item.claim,
                         paper=item.paper, ours=ours, verdict=verdict, notebook=item.notebook))
    return rows


def table_cell(text: str) -> str:
    """A table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def results_table(rows: list[dict[str, str]], link: Callable[[str], str] = lambda notebook: f"{notebook}.ipynb") -> str:
    """The rows of :func:`results` as a Markdown table, a bold row opening each group.

    >>> print(results_table([dict(group="G", title="Fig. x", claim="c", paper="p", ours="o",
    ...                           verdict="holds", notebook="fig_x")]))
    | item | claim | paper | ours | verdict | page |
    |---|---|---|---|---|---|
    | **G** | | | | | |
    | Fig. x | c | p | o | **holds** | [fig_x](fig_x.ipynb) |
    """
    lines, group = ["| item | claim | paper | ours | verdict | page |", "|---|---|---|---|---|---|"], None
    for r in rows:
        if r["group"] != group:
            group = r["group"]
            lines.append(f"| **{table_cell(group)}** | | | | | |")
        lines.append(f"| {table_cell(r['title'])} | {table_cell(r['claim'])} | {table_cell(r['paper'])} | {table_cell(r['ours'])} "
                     f"| **{table_cell(r['verdict'])}** | [{r['notebook']}]({link(r['notebook'])}) |")
    return "\n".join(lines)
