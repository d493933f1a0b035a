r"""The scale study (beyond the paper): does GFWSVD's gap to its rivals shrink with model size, and is it noise?

Used only by ``notebooks/fig_scale.py``. Three embedded decoders of growing size (SmolLM2-135M, Gemma 3 270M,
Qwen2.5-0.5B; :data:`fisherkron.hf.registry.DECODERS`), each run with one protocol, the decoder tables'
(:mod:`fisherkron.experiments.llm_compression`: C4 calibration, held-out sweep and selection batches, the
first tokens of PTB test and of a Wikipedia text in fixed windows), and every method with two allocations:
``fisher`` (Theorem 1's free curves) and ``calibrated_kl`` (those curves put on one scale by one KL point per
layer). The methods: FWSVD, ASVD, SVD-LLM, KFAC-SVD, GFWSVD and GFWSVD with its factors shrunk toward their
diagonals (``gfwsvd_shrunk``, :mod:`fisherkron.core.shrinkage`).

Every case keeps, beside its perplexities, the negative log-likelihood of each evaluation window
(:func:`~fisherkron.experiments.loss_noise.window_losses`), so the log-perplexity gap between two cases
comes with a paired standard error over windows (:func:`paired_gap`). :func:`gap_rows` puts GFWSVD's gap to its
best rival beside the size of each model's block linears, :func:`trend` says whether it shrinks with size,
:func:`shrinkage_effect` how much of it shrinkage closes, and :func:`rankings` whether the architecture changes
the methods' order.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from ..core.conventions import FisherkronError

__all__ = ["SCALE_METHODS", "SCALE_ALLOCATIONS", "RIVALS", "block_linear_params", "run_model", "window_ppl",
           "paired_gap", "best_case", "gap_rows", "trend", "shrinkage_effect", "rankings", "layer_type", "intensities",
           "model_record_path", "read_model_record", "write_model_record"]

#: the methods of the study, in the order of its tables
SCALE_METHODS = ("fwsvd", "asvd", "svd_llm", "kfac_svd", "gfwsvd", "gfwsvd_shrunk")
#: the allocations every method is run with: Theorem 1's free curves, and the curves calibrated by one KL point
SCALE_ALLOCATIONS = ("fisher", "calibrated_kl")
#: GFWSVD's rivals in the gap: the paper's strongest baseline and the strongest we know of
RIVALS = ("svd_llm", "kfac_svd")
#: bump when the meaning of a kept model record changes
MODEL_RECORD_VERSION = 1


def block_linear_params(model, names) -> int:
    """Parameters (weights and biases) of the layers ``names`` of ``model``: what a method can compress."""
    mods = dict(model.named_modules())
    return int(sum(p.numel() for n in names for p in mods[n].parameters()))


def layer_type(name: str) -> str:
    """The projection a layer name ends with (``q_proj``, ``down_proj``, ...).

    >>> layer_type("model.layers.3.mlp.down_proj")
    'down_proj'
    """
    return name.rsplit(".", 1)[-1]


def intensities(study) -> list[dict]:
    """Per layer: the split-half shrinkage intensities ``lambda_A``, ``lambda_B`` of ``gfwsvd_shrunk`` (read from
    the factors the study's compression cached, or computed here once)."""
    from ..hf.sensitivity import layer_statistics

    rows = []
    for name in study.names:
        lam_A, lam_B = layer_statistics(study.stats, "gfwsvd_shrunk", name, study.mff_options)["shrinkage"]
        rows.append({"layer": name, "type": layer_type(name), "lambda_A": lam_A, "lambda_B": lam_B})
    return rows


def window_ppl(windows: dict) -> float:
    """The perplexity of one text from its :func:`window_losses` record.

    >>> round(window_ppl({"nll": [511 * math.log(10.0)] * 2, "tokens": 511}), 6)
    10.0
    """
    nll = np.asarray(windows["nll"], dtype=float)
    return float(np.exp(nll.sum() / (len(nll) * windows["tokens"])))


def paired_gap(a: dict, b: dict) -> dict:
    r"""The log-perplexity gap ``log ppl(a) - log ppl(b)`` of two cases on the same windows, and its standard error.

    Per window ``w``: ``d_w = (nll_a,w - nll_b,w) / tokens``; the gap is ``mean_w d_w`` (exactly the difference of
    the two log perplexities, every window having the same tokens) and its standard error ``sd(d_w) / sqrt(W)``:
    windows, not tokens, are the independent units (the tokens of one window share their context).
    ``a`` and ``b``: ``{text: window_losses record}``; the windows of all texts are pooled.

    >>> g = paired_gap({"t": {"nll": [2.0, 4.0], "tokens": 1}}, {"t": {"nll": [1.0, 1.0], "tokens": 1}})
    >>> g["gap"], round(g["se"], 6), g["windows"]
    (2.0, 1.0, 2)
    """
    d = []
    for text in sorted(a):
        if text not in b or len(a[text]["nll"]) != len(b[text]["nll"]) or a[text]["tokens"] != b[text]["tokens"]:
            raise FisherkronError(f"the two cases were scored on different windows of {text!r}; score both with "
                                  f"the same protocol")
        d += list((np.asarray(a[text]["nll"]) - np.asarray(b[text]["nll"])) / a[text]["tokens"])
    d = np.asarray(d, dtype=float)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"gap": float(d.mean()), "se": se, "windows": int(len(d))}


def run_model(protocol, methods=SCALE_METHODS, allocations=SCALE_ALLOCATIONS, ratios=(0.1, 0.2), *,
              zero_shot=(), progress: bool = True) -> dict:
    """Every case of one model: ``{"model", "params", "block_params", "layers", "dense", "rows", "intensities",
    "timings", "first"}``.

    The model is prepared once (:func:`~fisherkron.experiments.llm_compression.prepare`: calibration cached), its
    cases run method by method (each method's weighted SVDs computed once for all its cases) and scored on the
    held-out selection loss and the evaluation windows; every score comes from, or goes to, the study's cache,
    so an interrupted run resumes at the next case. ``zero_shot``: ``(method, allocation, ratio)`` cases (and
    ``("dense", "dense", 0.0)``) also scored on the zero-shot tasks. The finished result is kept
    (:func:`model_record_path`) and read back by a later run, which then only loads the model to fingerprint it
    (``"timings"`` empty, ``"cached"`` naming the record). The model is freed before returning.
    """
    from tqdm.auto import tqdm

    from .. import hf
    from ..hf.budget import count_params
    from ..hf.calibration import model_fingerprint
    from . import llm_compression as lc
    from .llm_summary import flatten

    lc.check_reachable(protocol.model_name, "fig_scale")
    loaded = hf.load_model(protocol.model_name)
    want_zs = {(m, a, round(float(r), 6)) for m, a, r in zero_shot}
    path = model_record_path(protocol, methods, allocations, ratios, want_zs, model_fingerprint(loaded[0]))
    kept = read_model_record(path)
    if kept is not None:  # every case, the intensities and the sizes, as the run that finished them wrote them
        del loaded
        gc.collect()
        return {**kept, "timings": {}, "cached": {"model record": 1}}
    study = lc.prepare(protocol, target="fig_scale", progress=progress, loaded=loaded)
    del loaded

    def kinds(method, allocation, ratio):
        return ("heldout", "windows") + (("zeroshot",) if (method, allocation, round(ratio, 6)) in want_zs else ())

    def row(case, got):
        out = {"model": protocol.model_name, "method": case.method, "allocation": case.allocation,
               "target": case.ratio, **flatten(got), "windows": got["windows"]}
        for text, rec in got["windows"].items():
            out[f"ppl_{text}"] = window_ppl(rec)
        return out

    dense_case = lc.Case("dense", "dense", 0.0)
    rows = [row(dense_case, study.scores(dense_case, kinds("dense", "dense", 0.0)))]
    jobs = [(m, a, t) for m in methods for a in allocations for t in ratios]
    bar = tqdm(jobs, desc=f"{protocol.model_name}: cases (method x allocation x ratio)", disable=not progress)
    for method, allocation, target in bar:
        case = lc.Case(method, allocation, target)
        rows.append(row(case, study.scores(case, kinds(method, allocation, target), progress=progress)))
    lam = intensities(study) if "gfwsvd_shrunk" in methods else []
    out = {"model": protocol.model_name, "params": count_params(study.model),
           "block_params": block_linear_params(study.model, study.names), "layers": len(study.names),
           "dense": rows[0], "rows": rows, "intensities": lam, "timings": dict(study.timings),
           "first": lc.first_seconds(study.first), "cached": dict(study.cached)}
    del study
    gc.collect()
    write_model_record(path, out)
    return out


def model_record_path(protocol, methods, allocations, ratios, zero_shot: set, model_key: str) -> Path:
    """Where :func:`run_model` keeps one model's finished result: named by the hash of everything it depends on
    (the protocol, the cases, the dense model's fingerprint, the code of every score (:func:`~fisherkron.
    experiments.llm_compression.code_tag`) and of this module), so a resumed study reads a model it finished
    without calibrating it again or recomputing its split-half factors."""
    from ..env import code_digest, data_root
    from . import llm_compression as lc

    cfg = {"version": MODEL_RECORD_VERSION, "protocol": dataclasses.asdict(protocol), "methods": list(methods),
           "allocations": list(allocations), "ratios": [round(float(r), 6) for r in ratios],
           "zero_shot": sorted(list(z) for z in zero_shot), "model": model_key, "code": lc.code_tag(),
           "scale": code_digest([Path(__file__)])}
    key = hashlib.blake2b(json.dumps(cfg, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    return data_root() / "cache" / "studies" / "scale" / f"{protocol.model_name}-{key}.json"


def read_model_record(path: Path) -> dict | None:
    """The result :func:`write_model_record` kept at ``path``, or ``None`` (missing or unreadable: computed again)."""
    try:
        got = json.loads(Path(path).read_text()) if Path(path).is_file() else None
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and "rows" in got else None


def write_model_record(path: Path, result: dict) -> None:
    """Keep one model's finished result at ``path`` (atomically)."""
    from ..env import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda t: Path(t).write_text(json.dumps(result, default=float)))


def best_case(rows: list[dict], model: str, method: str, target: float) -> dict | None:
    """The case of ``method`` at ``target`` whose allocation has the lowest held-out selection loss."""
    from .llm_compression import best_allocation

    mine = {r["allocation"]: r for r in rows if r["model"] == model and r["method"] == method
            and math.isclose(r["target"], target)}
    if not mine:
        return None
    return mine[best_allocation({a: r.get("loss", math.nan) for a, r in mine.items()}, tuple(mine))]


def gap_rows(models: list[dict], targets, rivals=RIVALS, of: str = "gfwsvd") -> list[dict]:
    """Per model and target ratio: ``of``'s log-perplexity gap to each rival and to the best of them, each method
    with its best allocation (held-out selection loss), with paired standard errors over windows."""
    out = []
    for res in models:
        for t in targets:
            me = best_case(res["rows"], res["model"], of, t)
            if me is None:
                continue
            row = {"model": res["model"], "block_params": res["block_params"], "target": t, "allocation": me["allocation"]}
            best = None
            for rival in rivals:
                r = best_case(res["rows"], res["model"], rival, t)
                if r is None:
                    continue
                g = paired_gap(me["windows"], r["windows"])
                row[f"gap_{rival}"], row[f"se_{rival}"] = g["gap"], g["se"]
                if best is None or g["gap"] > best[1]["gap"]:  # the rival that beats `of` by the most
                    best = (rival, g)
            if best is not None:
                row.update(best_rival=best[0], gap=best[1]["gap"], se=best[1]["se"], windows=best[1]["windows"])
            out.append(row)
    return out


def trend(gaps: list[dict], target: float) -> dict:
    """Does the gap shrink with size at ``target``? The gap at the smallest and the largest model, their
    difference with its standard error (independent models: the errors add in quadrature), and the slope of
    the gap against ``log10`` of the block-linear parameters (least squares; ``nan`` with fewer than 2 models).
    ``shrinks``: the largest model's gap is below the smallest's by more than two standard errors;
    ``grows``: above it by more than two; neither: the sizes cannot tell."""
    g = sorted((r for r in gaps if math.isclose(r["target"], target) and "gap" in r), key=lambda r: r["block_params"])
    if not g:
        return {"models": 0}
    lo, hi = g[0], g[-1]
    diff = hi["gap"] - lo["gap"]
    se = math.hypot(lo["se"], hi["se"])
    x = np.log10([r["block_params"] for r in g])
    slope = float(np.polyfit(x, [r["gap"] for r in g], 1)[0]) if len(g) > 1 else float("nan")
    return {"models": len(g), "smallest": lo["model"], "largest": hi["model"], "gap_smallest": lo["gap"],
            "gap_largest": hi["gap"], "change": diff, "se": se, "slope_per_decade": slope,
            "shrinks": bool(len(g) > 1 and diff < -2 * se), "grows": bool(len(g) > 1 and diff > 2 * se)}


def shrinkage_effect(models: list[dict], targets, allocation: str = "calibrated_kl") -> list[dict]:
    """Per model and target, under one ``allocation``: the log-perplexity gap of ``gfwsvd_shrunk`` to ``gfwsvd``
    (negative: shrinkage helps) with its paired standard error, each one's gap to KFAC-SVD, and the share of
    GFWSVD's gap to KFAC-SVD that shrinkage closes (``nan`` where GFWSVD is not behind)."""
    out = []
    for res in models:
        for t in targets:
            pick = {m: next((r for r in res["rows"] if r["method"] == m and r["allocation"] == allocation
                             and math.isclose(r["target"], t)), None) for m in ("gfwsvd", "gfwsvd_shrunk", "kfac_svd")}
            if any(v is None for v in pick.values()):
                continue
            d = paired_gap(pick["gfwsvd_shrunk"]["windows"], pick["gfwsvd"]["windows"])
            g_plain = paired_gap(pick["gfwsvd"]["windows"], pick["kfac_svd"]["windows"])["gap"]
            g_shrunk = paired_gap(pick["gfwsvd_shrunk"]["windows"], pick["kfac_svd"]["windows"])["gap"]
            closed = (g_plain - g_shrunk) / g_plain if g_plain > 0 else float("nan")
            out.append({"model": res["model"], "target": t, "allocation": allocation, "shrunk_vs_plain": d["gap"],
                        "se": d["se"], "gap_plain_to_kfac": g_plain, "gap_shrunk_to_kfac": g_shrunk,
                        "share_closed": closed})
    return out


def rankings(models: list[dict], target: float, allocation: str = "calibrated_kl", text: str = "ptb") -> dict:
    """Each model's methods ordered by ``text`` perplexity at ``target`` under ``allocation`` (best first), and
    Kendall's tau between every two models' orders (1: the same order)."""
    from scipy.stats import kendalltau

    order = {}
    for res in models:
        got = [(r[f"ppl_{text}"], r["method"]) for r in res["rows"] if r["allocation"] == allocation
               and math.isclose(r["target"], target)]
        order[res["model"]] = [m for _, m in sorted(got)]
    taus = {}
    names = list(order)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = [m for m in order[a] if m in order[b]]
            if len(common) >= 3:
                taus[f"{a} / {b}"] = float(kendalltau([order[a].index(m) for m in common],
                                                      [order[b].index(m) for m in common])[0])
    return {"order": order, "kendall_tau": taus}
