"""README blocks of the long SmolLM2 studies whose notebooks write their verdicts as sentences: the decoder
tables (Sec. 6.3, ``make tab_llm_compression_main``, ``tab_llm_compression_mmlu``, ``tab_ablation_diag``), the
allocation study (``make fig_allocation_cost``) and Sec. 6.4's extra compression
(``make tab_extra_compression_results``).

Each of these notebooks computes its verdicts from its own numbers and stores them, one Markdown line
each, in the ``"lines"`` of its summary record ``<notebook>_summary.provenance.json``. The blocks here only
copy what is committed:

* ``study-table:NAME``: the committed ``figures/NAME.md`` with its caption, the wall time and machine of the
  run that wrote it;
* ``study-verdicts:NAME``: the notebook's verdict lines (``NAME`` the notebook);
* ``allocation-headline``: the allocation study's result where the command-line section quotes it.

A study whose outputs are not committed yet renders a line saying so, with its Make target, and no
number; the README check then holds until the outputs land and ``make readme`` fills the block in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..allocation_cost import find_row
from .formats import ORDINALS, cpu, method_name, num, pct, perplexity, secs

if TYPE_CHECKING:
    from . import Outputs

#: the notebook whose Make target writes each table of these studies
NOTEBOOK = {
    "tab_llm_compression_main": "tab_llm_compression_main",
    "tab_llm_compression_mmlu": "tab_llm_compression_mmlu",
    "tab_ablation_diag": "tab_ablation_diag",
    "tab_gfwsvd_transposed": "tab_ablation_diag",
    "tab_allocation_cost": "fig_allocation_cost",
    "tab_extra_compression_results": "tab_extra_compression_results",
}


def _pending(notebook: str) -> str:
    return (f"*Not yet run: `make {notebook}` writes these outputs (its progress is in the issue notes); "
            f"this block fills in from them with `make readme`.*")


def _committed(out: Outputs, name: str, suffix: str) -> bool:
    return (out.folder / f"{name}{suffix}").is_file()


def study_table(out: Outputs, name: str) -> str:
    """The committed table ``figures/NAME.md``, its caption and the run that wrote it."""
    notebook = NOTEBOOK.get(name, name)
    if not (_committed(out, name, ".md") and _committed(out, name, ".provenance.json")):
        return _pending(notebook)
    rec = out.record(name)
    body = out.markdown(name).strip()
    caption = rec.get("caption")
    head = f"`figures/{name}.md`, written by `make {notebook}` in {secs(out.wall(name))} on {cpu(out, name)}"
    lines = [f"**{head}.**" + (f" {caption}" if caption else ""), "", body]
    return "\n".join(lines)


def study_verdicts(out: Outputs, notebook: str) -> str:
    """The verdict lines the notebook computed, from its summary record."""
    summary = f"{notebook}_summary"
    if not _committed(out, summary, ".provenance.json"):
        return _pending(notebook)
    lines = out.extra(summary).get("lines") or []
    return "\n".join(lines) if lines else f"*`{summary}` records no verdicts.*"


def decoder_headline(out: Outputs, notebook: str) -> str:
    """Where GFWSVD stands in a decoder table: per ratio, its place among the methods by PTB perplexity in the
    "best allocation here" block (each method at its best allocation), against the best method and the dense
    model, from the summary record's rows."""
    summary = f"{notebook}_summary"
    if not _committed(out, summary, ".provenance.json"):
        return _pending(notebook)
    rows = [r for r in out.extra(summary).get("rows", []) if r.get("block") == "best" and r.get("ppl_ptb")]
    dense = out.extra(summary)["verdict"]["dense"]["ppl_ptb"]
    lines, places = [], []
    for t in sorted({r["target"] for r in rows}):
        ranked = sorted((r for r in rows if r["target"] == t), key=lambda r: r["ppl_ptb"])
        g = next((i for i, r in enumerate(ranked) if r["method"] == "gfwsvd"), None)
        if g is None:
            continue
        mine, place = ranked[g], ORDINALS[g] if g < len(ORDINALS) else f"#{g + 1}"
        places.append(g + 1)
        ahead = ", ".join(f"{method_name(r['method'])} {perplexity(r['ppl_ptb'])}" for r in ranked[:g])
        lines.append(f"  - {pct(t)}: GFWSVD {perplexity(mine['ppl_ptb'])} "
                     f"({num(mine['ppl_ptb'] / dense, 1)}× dense), {place} of {len(ranked)}"
                     + (f"; ahead of it: {ahead}" if g else "") + ".")
    if not places:
        return f"*`{summary}` has no GFWSVD row in its best-allocation block.*"
    first = sum(p == 1 for p in places)
    head = (f"* **GFWSVD {'leads' if first == len(places) else 'is not ahead'} at this scale**: "
            f"first by PTB perplexity at {first} of {len(places)} ratios, each method at its best allocation "
            f"(dense model {num(dense, 1)}; KFAC-SVD is not in the paper):")
    return "\n".join([head, *lines])


def allocation_headline(out: Outputs) -> str:
    """The allocation study's result as the command-line section quotes it: GFWSVD at the target ratios under
    uniform, the sweep and the better calibrated variant (with the evaluations each spent), how often the target
    was met, and the best row at the larger ratio, from ``fig_allocation_cost_summary``."""
    summary = "fig_allocation_cost_summary"
    if not _committed(out, summary, ".provenance.json"):
        return _pending("fig_allocation_cost")
    ex = out.extra(summary)
    v, rows = ex["verdict"], ex["rows"]
    variant = v["calibrated_variant"]
    flag = "`--allocation calibrated --calibrate-metric kl`" if variant == "calibrated_kl" else "`--allocation calibrated`"
    ratios = sorted(float(t) for t in next(iter(v["target"].values())))
    def ppl(m, a, t):
        return perplexity(find_row(rows, m, a, t)["ppl_ptb"])

    met = [g["met"] for per in v["target"].values() for g in per.values()]
    parts = []
    for t in ratios[::-1]:
        parts.append(f"at {pct(t)} GFWSVD's PTB is {ppl('gfwsvd', variant, t)} with it, against "
                     f"{ppl('gfwsvd', 'sensitivity', t)} with the paper's sweep and {ppl('gfwsvd', 'uniform', t)} "
                     "with one ratio for every layer")
    t = ratios[-1]
    at = [r for r in rows if abs(r["target"] - t) < 1e-9]
    best = min(at, key=lambda r: r["ppl_ptb"])
    ev = lambda a: f"{find_row(rows, 'gfwsvd', a, t)['evaluations']:,}"  # noqa: E731
    head = "One measured point per layer beats the paper's sweep" if all(m is True for m in met) else \
        "One measured point per layer does not always beat the paper's sweep"
    return (f"**{head}** (allocation study below, k = {out.params(summary)['k']} calibration batches): {flag} "
            f"spends {ev(variant)} model evaluations against the sweep's {ev('sensitivity')}; " + "; ".join(parts) + ". It meets the study's "
            f"target (at most the better of the sweep and the fisher allocation, ahead of LEMS) in "
            f"{sum(m is True for m in met)} of {len(met)} (method, ratio) pairs. The best row at {pct(t)} is "
            f"{method_name(best['method'])} with `{best['allocation']}` ({perplexity(best['ppl_ptb'])}); GFWSVD is "
            f"{'ahead' if best['method'] == 'gfwsvd' else 'not ahead'} at this scale.")


BLOCKS = {"study-table": study_table, "study-verdicts": study_verdicts, "decoder-headline": decoder_headline,
          "allocation-headline": allocation_headline}
