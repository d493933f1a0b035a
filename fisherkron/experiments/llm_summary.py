r"""Tables and verdicts of the decoder study (Sec. 6.3, Tabs. Llama31_compression_50, Llama2_chat_compression_50,
Llama2_compression, Llama3_compression, ablation_diag_results) from the rows of
:mod:`fisherkron.experiments.llm_compression`, and the reading of lm-eval's results.

A row is one compressed model in one block of a table: ``block`` (``"paper"``: each method as the paper
ran it; ``"best"``: each method with its best allocation here), ``target`` (the target whole-model
ratio), ``method``, ``allocation``, the achieved ``ratio`` and ``layers_ratio``, and its scores
(``ppl_wiki``, ``ppl_ptb``, ``<task>`` / ``<task>_se`` accuracies, ``average`` / ``average_se``,
``mmlu_<category>`` / ``..._se``).

* reading lm-eval: :func:`pooled_accuracy`, :func:`zero_shot_scores`, :func:`mmlu_categories`,
  :func:`mmlu_scores` (``acc`` for every task, the paper's convention: :data:`METRIC`);
* tables in the paper's layout, best per block in bold: :func:`main_table`, :func:`mmlu_table`,
  :func:`ablation_table`, :func:`transposed_table`, written by :func:`save` (the ``.tex`` with
  ``\textbf`` and ``$\pm$``);
* verdicts computed from the numbers: :func:`compare`, :func:`degradation`, :func:`ablation_order`,
  :func:`collapsed`, :func:`chance_level`.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.conventions import FisherkronError

__all__ = ["NAMES", "ZERO_SHOT", "TASK_NAMES", "METRIC", "MMLU_CATEGORIES", "CATEGORY_NAMES", "CHANCE_MMLU",
           "pooled_accuracy", "zero_shot_scores", "mmlu_categories", "mmlu_scores", "flatten", "fmt_acc", "fmt_ppl",
           "main_table", "mmlu_table", "ablation_table", "transposed_table", "latex", "save", "gap", "compare",
           "degradation", "ablation_order", "collapsed", "chance_level", "cost_line"]

NAMES = {"dense": "Full model", "fwsvd": "FWSVD", "asvd": "ASVD", "svd_llm": "SVD-LLM",
         "basis_sharing": "Basis Sharing", "gfwsvd": "GFWSVD", "kfac_svd": "KFAC-SVD (not in the paper)",
         "gfwsvd_diag": "Diag GFWSVD", "gfwsvd_offdiag": "Non-diag GFWSVD",
         "gfwsvd_transposed": "GFWSVD, L_B untransposed (lems)", "svd": "SVD"}
#: the zero-shot tasks of Tabs. Llama31_compression_50 / Llama2_chat_compression_50, in the paper's order
ZERO_SHOT = ("arc_challenge", "arc_easy", "hellaswag", "piqa", "winogrande", "openbookqa")
TASK_NAMES = {"arc_challenge": "ARC-C", "arc_easy": "ARC-E", "hellaswag": "HellaSwag", "piqa": "PIQA",
              "winogrande": "WinoG.", "openbookqa": "OpenBook"}
#: the metric reported per task: lm-eval's ``acc`` everywhere. The paper's dense rows are ``acc`` (Llama-2-7B-chat:
#: HellaSwag 0.58 and OpenBookQA 0.33, where ``acc_norm`` is about 0.75 and 0.44); MMLU has only ``acc``
METRIC = {**{t: "acc" for t in ZERO_SHOT}, "mmlu": "acc"}
#: MMLU's four categories (lm-eval's, from Hendrycks et al.), in the paper's column order
MMLU_CATEGORIES = ("humanities", "other", "social_sciences", "stem")
CATEGORY_NAMES = {"average": "MMLU Avg", "humanities": "Humanities", "other": "Other",
                  "social_sciences": "Social Sciences", "stem": "STEM"}
CHANCE_MMLU = 0.25
BLOCKS = {"paper": "as the paper ran them", "best": "best allocation here"}


# ----------------------------------------------------------------------------- reading lm-eval

def pooled_accuracy(parts) -> tuple[float, float, int]:
    r"""Accuracy and standard error of the union of tasks given as ``(acc, n)``, weighted by size.

    All ``N = sum n`` answers are one sample of 0/1 outcomes: ``acc = sum n_i acc_i / N``,
    ``se = sqrt(acc (1 - acc) / (N - 1))`` (lm-eval's ``mean_stderr`` of the pooled sample, which is
    what its size-weighted groups report).

    >>> pooled_accuracy([(1.0, 1), (0.0, 1)])
    (0.5, 0.5, 2)
    """
    parts = list(parts)
    N = sum(n for _, n in parts)
    if N == 0:
        return float("nan"), float("nan"), 0
    acc = sum(a * n for a, n in parts) / N
    se = math.sqrt(acc * (1 - acc) / (N - 1)) if N > 1 else float("nan")
    return acc, se, N


def zero_shot_scores(results: dict) -> dict:
    """``{task: {"acc", "se", "n"}}`` (:data:`METRIC`) and their unweighted ``average``, whose standard
    error is ``sqrt(sum se_t^2) / 6`` (independent tasks); a task scored ``per_example``
    (:func:`fisherkron.hf.evaluate.run_lm_eval`) also keeps ``"examples"``, each example's score, for
    :func:`paired_gap`."""
    out = {}
    for t in ZERO_SHOT:
        if t not in results:
            raise FisherkronError(f"lm-eval gave no result for {t}")
        r = results[t]
        metric = METRIC[t]
        out[t] = {"acc": float(r[metric]), "se": float(r.get(f"{metric}_stderr", float("nan"))),
                  "n": int(r.get("sample_len", 0))}
        if f"{metric}_examples" in r:
            out[t]["examples"] = [float(x) for x in r[f"{metric}_examples"]]
    accs = [out[t]["acc"] for t in ZERO_SHOT]
    out["average"] = {"acc": sum(accs) / len(accs),
                      "se": math.sqrt(sum(out[t]["se"] ** 2 for t in ZERO_SHOT)) / len(ZERO_SHOT),
                      "n": sum(out[t]["n"] for t in ZERO_SHOT)}
    return out


def mmlu_categories() -> dict[str, str]:
    """``{subject: category}`` of MMLU's 57 subjects, read from lm-eval's own task definitions."""
    import lm_eval

    folder = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
    out = {}
    for path in sorted(folder.glob("mmlu_*.yaml")):
        m = re.search(r'^"?tag"?:\s*"?mmlu_(\w+)_tasks"?\s*$', path.read_text(), re.M)
        if m:
            out[path.stem.removeprefix("mmlu_")] = m.group(1)
    if len(out) != 57 or set(out.values()) != set(MMLU_CATEGORIES):
        raise FisherkronError(f"lm-eval's MMLU task definitions in {folder} give {len(out)} subjects in "
                              f"{sorted(set(out.values()))}; expected 57 in {', '.join(MMLU_CATEGORIES)}")
    return out


def mmlu_scores(results: dict, categories: dict[str, str] | None = None, subjects=None) -> dict:
    """MMLU's ``average`` and its four categories (``{"acc", "se", "n"}``, :func:`pooled_accuracy` of the
    subjects' answers) from lm-eval's per-subject results ``mmlu_<subject>``.

    ``subjects``: the subjects that were run (default: all 57, each of which must have a result); a
    category none of them belongs to is ``nan``.
    """
    categories = categories or mmlu_categories()
    subjects = list(categories) if subjects is None else list(subjects)
    unknown = [s for s in subjects if s not in categories]
    if unknown:
        raise FisherkronError(f"{unknown[0]!r} is no MMLU subject; use the names of lm-eval's mmlu_<subject> tasks")
    parts: dict[str, list] = {c: [] for c in MMLU_CATEGORIES}
    for subject in subjects:
        r = results.get(f"mmlu_{subject}")
        if r is None:
            raise FisherkronError(f"lm-eval gave no result for mmlu_{subject}")
        parts[categories[subject]].append((float(r["acc"]), int(r["sample_len"])))
    out = {cat: dict(zip(("acc", "se", "n"), pooled_accuracy(parts[cat]))) for cat in MMLU_CATEGORIES}
    out["average"] = dict(zip(("acc", "se", "n"), pooled_accuracy(x for c in MMLU_CATEGORIES for x in parts[c])))
    return out


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def flatten(scores: dict) -> dict:
    """One flat row from a case's ``{kind: result}``: ``ppl_<text>``, ``<task>`` / ``<task>_se``,
    ``mmlu_<category>`` / ``..._se``, the held-out ``loss``, ``ratio`` and ``layers_ratio``."""
    row = {}
    held = scores.get("heldout", {})
    for k in ("loss", "ratio", "layers_ratio", "compress_seconds"):
        if k in held:
            row[k] = _num(held[k])
    for text, ppl in scores.get("ppl", {}).items():
        row[f"ppl_{text}"] = _num(ppl)
    for task, r in scores.get("zeroshot", {}).items():
        row[task], row[f"{task}_se"], row[f"{task}_n"] = _num(r["acc"]), _num(r["se"]), r["n"]
        if "examples" in r:
            row[f"{task}_examples"] = list(r["examples"])
    for cat, r in scores.get("mmlu", {}).items():
        row[f"mmlu_{cat}"], row[f"mmlu_{cat}_se"], row[f"mmlu_{cat}_n"] = _num(r["acc"]), _num(r["se"]), r["n"]
    return row


# ----------------------------------------------------------------------------- tables

def selection_table(selections: dict) -> pd.DataFrame:
    """One row per (method, target) of :func:`~fisherkron.experiments.llm_compression.run_table`'s selections: each
    allocation's held-out selection loss (``loss_<allocation>``), the chosen one and those out of reach.

    >>> selection_table({"m": {0.1: {"losses": {"uniform": 5.0}, "best": "uniform", "infeasible": ["sensitivity"]}}})
      method  target  loss_uniform     best out_of_reach
    0      m     0.1           5.0  uniform  sensitivity
    """
    return pd.DataFrame([{"method": m, "target": t, **{f"loss_{a}": v for a, v in s["losses"].items()},
                          "best": s["best"], "out_of_reach": ", ".join(s["infeasible"])}
                         for m, per in selections.items() for t, s in per.items()])


def fmt_acc(acc: float, se: float, digits: int = 2) -> str:
    """``"0.31 ± 0.01"``; standard errors below 0.01 get one more digit (the paper's ``± 0.003``)."""
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):
        return ""
    if se is None or not math.isfinite(se):
        return f"{acc:.{digits}f}"
    d = digits + 1 if se < 10 ** -digits else digits
    return f"{acc:.{digits}f} ± {se:.{d}f}"


def fmt_ppl(ppl: float) -> str:
    """Perplexity as the paper prints it: two decimals below 100, whole numbers above, ``1.2e6`` beyond a million."""
    if ppl is None or (isinstance(ppl, float) and math.isnan(ppl)):
        return ""
    if ppl >= 1e6:
        return f"{ppl:.2g}"
    return f"{ppl:.2f}" if ppl < 100 else f"{ppl:,.0f}"


def _ratio_cell(r) -> str:
    return f"{100 * r['ratio']:.1f} % ({100 * r['layers_ratio']:.1f} %)"


def _method_cell(r) -> str:
    name = NAMES.get(r["method"], r["method"])
    if r["method"] in ("dense", "basis_sharing") or r.get("allocation") in (None, "own", "dense", "ranks"):
        return name
    return f"{name} [{r['allocation']}]"


def _infeasible(r) -> bool:
    v = r.get("infeasible", False)
    return bool(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) else False


def _scored(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that have scores (an allocation out of reach of the ratio has none)."""
    if "infeasible" not in rows:
        return rows
    return rows[~rows["infeasible"].fillna(False).astype(bool)]


def _bold(cells: list[str], values: list[float], higher: bool) -> list[str]:
    """Bold the best finite value(s) of a block (ties all bold)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return cells
    best = max(finite) if higher else min(finite)
    return [f"**{c}**" if v is not None and math.isfinite(v) and v == best and c else c
            for c, v in zip(cells, values)]


def _table(rows: pd.DataFrame, targets, columns: list[tuple[str, str, str | None, bool]], dense: dict,
           blocks=("paper", "best")) -> pd.DataFrame:
    """Rows in blocks per target ratio; ``columns``: (header, value column, se column or None, higher is better)."""
    out = []

    def cells(r) -> dict:
        if _infeasible(r):
            return {"Method": f"{_method_cell(r)}: out of reach", "C. Ratio (linear)": "",
                    **{head: "n/a" for head, *_ in columns}}
        c = {"Method": _method_cell(r), "C. Ratio (linear)": _ratio_cell(r) if r["method"] != "dense" else "0 %"}
        for head, col, se, _ in columns:
            v = r.get(col, float("nan"))
            c[head] = fmt_ppl(v) if se is None else fmt_acc(v, r.get(se, float("nan")))
        return c

    out.append({"Block": "", **cells({**dense, "method": "dense"})})
    for target in targets:
        for block in blocks:
            sub = rows[np.isclose(rows["target"], target) & (rows["block"] == block)]
            if sub.empty:
                continue
            recs = [r for _, r in sub.iterrows()]
            table = [cells(r) for r in recs]
            for head, col, _, higher in columns:
                marked = _bold([t[head] for t in table], [float(r.get(col, float("nan"))) for r in recs], higher)
                for t, m in zip(table, marked):
                    t[head] = m
            for t in table:
                out.append({"Block": f"{100 * target:g} %, {BLOCKS[block]}", **t})
    return pd.DataFrame(out)


def main_table(rows: pd.DataFrame, targets, dense: dict) -> pd.DataFrame:
    """Tabs. Llama31_compression_50 / Llama2_chat_compression_50: perplexities, six zero-shot accuracies ± se and
    their average per method, ratio and block; best per block in bold; the dense model first."""
    cols = [("Wiki (WT2 role)", "ppl_wiki", None, False), ("PTB", "ppl_ptb", None, False)]
    cols += [(TASK_NAMES[t], t, f"{t}_se", True) for t in ZERO_SHOT]
    cols += [("AVG", "average", "average_se", True)]
    return _table(rows, targets, cols, dense)


def mmlu_table(rows: pd.DataFrame, targets, dense: dict, chance: float = CHANCE_MMLU) -> pd.DataFrame:
    """Tabs. Llama2_compression / Llama3_compression: perplexities, 5-shot MMLU average and its four categories ± se;
    the dense model and the chance level first."""
    cols = [("Wiki (WT2 role)", "ppl_wiki", None, False), ("PTB", "ppl_ptb", None, False)]
    cols += [(CATEGORY_NAMES[c], f"mmlu_{c}", f"mmlu_{c}_se", True) for c in ("average", *MMLU_CATEGORIES)]
    df = _table(rows, targets, cols, dense)
    chance_row = {"Block": "", "Method": "chance (4 choices)", "C. Ratio (linear)": "",
                  **{CATEGORY_NAMES[c]: f"{chance:.2f}" for c in ("average", *MMLU_CATEGORIES)}}
    return pd.concat([df.iloc[:1], pd.DataFrame([chance_row]), df.iloc[1:]], ignore_index=True).fillna("")


def ablation_table(rows: pd.DataFrame, targets, order=("fwsvd", "gfwsvd_diag", "gfwsvd_offdiag", "gfwsvd"),
                   dense: dict | None = None) -> pd.DataFrame:
    """Tab. ablation_diag_results: Wikipedia-text and PTB perplexity of each row (same ranks) at each ratio,
    the best per column in bold."""
    out = []
    for m in order:
        out.append({"Method / Dataset": NAMES.get(m, m)})
    table = pd.DataFrame(out)
    for target in targets:
        for text, head in (("wiki", "Wiki (WT2 role)"), ("ptb", "PTB")):
            col = f"{head} {100 * target:g} %"
            vals = []
            for m in order:
                sub = rows[(rows["method"] == m) & np.isclose(rows["target"], target)]
                vals.append(float(sub.iloc[0][f"ppl_{text}"]) if len(sub) else float("nan"))
            table[col] = _bold([fmt_ppl(v) for v in vals], vals, higher=False)
    if dense is not None:
        extra = {"Method / Dataset": NAMES["dense"]}
        for c in table.columns[1:]:
            extra[c] = fmt_ppl(dense["ppl_wiki" if c.startswith("Wiki") else "ppl_ptb"])
        table = pd.concat([pd.DataFrame([extra]), table], ignore_index=True)
    return table


def transposed_table(rows: pd.DataFrame, targets) -> pd.DataFrame:
    """The pitfall: GFWSVD (Eq. (7), ``L_B^T W L_A``) against the untransposed ``L_B W L_A`` at the same
    factors and ranks: perplexities and the held-out loss per ratio."""
    out = []
    for target in targets:
        for m in ("gfwsvd", "gfwsvd_transposed"):
            sub = rows[(rows["method"] == m) & np.isclose(rows["target"], target)]
            if sub.empty:
                continue
            r = sub.iloc[0]
            out.append({"C. Ratio": f"{100 * target:g} %", "Method": NAMES[m],
                        "transform": "L_B^T W L_A (Eq. 7)" if m == "gfwsvd" else "L_B W L_A",
                        "Wiki (WT2 role)": fmt_ppl(r["ppl_wiki"]), "PTB": fmt_ppl(r["ppl_ptb"]),
                        "held-out loss": f"{r['loss']:.4f}"})
    return pd.DataFrame(out)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex_cell(text: str) -> str:
    bold = text.startswith("**") and text.endswith("**") and len(text) > 4
    core = text[2:-2] if bold else text
    core = "".join(_TEX.get(c, c) for c in core).replace("±", r"$\pm$")
    return rf"\textbf{{{core}}}" if bold else core


def latex(df: pd.DataFrame, caption: str, label: str) -> str:
    r"""The table in LaTeX as the paper sets it: booktabs, bold cells as ``\textbf``, ``±`` as ``$\pm$``, a
    rule between blocks (a change of the first column)."""
    align = "l" * min(2, len(df.columns)) + "c" * (len(df.columns) - min(2, len(df.columns)))
    lines = [r"\begin{table*}[!htbp]", r"\centering", rf"\caption{{{_tex_cell(caption)}}}", rf"\label{{{label}}}",
             r"\resizebox{\textwidth}{!}{%", rf"\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(_tex_cell(str(c)) for c in df.columns) + r" \\", r"\midrule"]
    prev = None
    for row in df.itertuples(index=False):
        if prev is not None and row[0] != prev and row[0]:
            lines.append(r"\midrule")
        prev = row[0]
        lines.append(" & ".join(_tex_cell(str(v)) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


#: What a decoder-table column holds, by its name (first match wins); :func:`tolerances` turns the kind into
#: ``make verify``'s tolerance. Ranks decided near a threshold or by the integer program can move with float32
#: differences between CPUs, so the scores get a tolerance and the configuration none.
COLUMN_KINDS = (
    (re.compile(r"seconds|time", re.I), "timing"),
    (re.compile(r"^(Block|Method|Stage|Seeds?|transform|Method / Dataset)$", re.I), "exact"),
    (re.compile(r"ratio", re.I), "ratio"),
    (re.compile(r"loss", re.I), "loss"),
    (re.compile(r"wiki|ptb|ppl|perplexity", re.I), "perplexity"),
    (re.compile(r"mmlu|humanities|other|social|stem|arc|hella|hswag|piqa|wino|openbook|avg|acc", re.I), "accuracy"),
)

#: The tolerance of each kind of column (grammar: :mod:`fisherkron.repro.tolerance`), whatever the cells'
#: spread means. A compression ratio is counted parameters (1 % covers a rank moved by the allocation); a
#: held-out loss and a perplexity come from float32 forward passes of a compressed model, which amplifies a
#: singular vector moved by another CPU's summation order (0.02 nats; 5 %). An accuracy with no spread printed
#: (one run of a deterministic row in a table of seed means) gets two examples of the 40 each zero-shot task
#: scores (0.05).
BASE_TOLERANCES = {"timing": "timing", "exact": "exact", "ratio": "rel=0.01", "loss": "abs=0.02",
                   "perplexity": "rel=0.05", "accuracy": "abs=0.05"}

#: An accuracy printed ``p ± se`` with one evaluation's standard error (the study's tables without seeds): one
#: standard error, and at least one example of the 40 (a cell at 0 or 1 has a standard error of 0). A re-run
#: scores the same examples, so the standard error is not the noise of a re-run (that is a few examples flipped
#: by float32 differences); it is the smallest difference the table can resolve, and the perplexities beside it
#: (5 %) are what catch a changed method.
ACCURACY_SE = "abs=0.025 + 1*pm"

#: Seed means printed ``mean ± sd`` over ``N`` seeds: three standard errors of the mean (sd / sqrt(N)) on top of
#: the kind's own tolerance, the rule of the GLUE tables (:mod:`fisherkron.repro.verify_tolerances`). A
#: model trained on another CPU diverges from the committed one as another seed's would, so the seeds' spread
#: is the noise of a re-run; with two seeds it is barely estimated, hence three standard errors, not two.
SEED_MEANS = "3*pm/sqrt({seeds})"


def tolerances(df: pd.DataFrame, seeds: int | None = None) -> dict[str, str]:
    """The verify tolerance of every column of a decoder table (:data:`COLUMN_KINDS`; ``exact`` otherwise).

    Args:
        seeds: the number of seeds when the table's ``±`` is a standard deviation over seeds (Tab.
            extra-compression-results): every score column gets :data:`SEED_MEANS` on top of its
            :data:`BASE_TOLERANCES`. ``None`` (the study's other tables): ``±`` is one evaluation's standard
            error, printed on accuracies only, which get :data:`ACCURACY_SE`.

    >>> cols = ["Method", "C. Ratio (linear)", "PTB 10 %", "ARC-E", "held-out loss"]
    >>> tolerances(pd.DataFrame(columns=cols))
    {'Method': 'exact', 'C. Ratio (linear)': 'rel=0.01', 'PTB 10 %': 'rel=0.05', 'ARC-E': 'abs=0.025 + 1*pm', 'held-out loss': 'abs=0.02'}
    >>> tolerances(pd.DataFrame(columns=cols), seeds=2)["PTB 10 %"]
    'rel=0.05 + 3*pm/sqrt(2)'
    """
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1):
        raise FisherkronError(f"tolerances(seeds=...) is the number of seeds behind the table's mean ± sd cells "
                              f"(a positive integer), or None when ± is one evaluation's standard error; got "
                              f"{seeds!r}")
    out = {}
    for c in df.columns:
        kind = next((k for pat, k in COLUMN_KINDS if pat.search(str(c))), "exact")
        spec = BASE_TOLERANCES[kind]
        if kind in ("loss", "perplexity", "accuracy") and seeds is not None:
            spec += " + " + SEED_MEANS.format(seeds=seeds)
        elif kind == "accuracy":
            spec = ACCURACY_SE
        out[str(c)] = spec
    return out


def save(df: pd.DataFrame, name: str, output_dir, params: dict, *, caption: str, label: str, notebook: str,
         started: float, extra: dict | None = None, seeds: int | None = None) -> list[Path]:
    """:func:`fisherkron.repro.figures.save_table` with the columns' verify :func:`tolerances` (``seeds``:
    the number of seeds behind ``mean ± sd`` cells, if the table has them), then the ``.tex`` rewritten in the
    paper's layout (:func:`latex`), atomically."""
    from ..env import atomic_write
    from ..repro import figures

    paths = figures.save_table(df, name, output_dir, params, caption=caption, label=label, started=started,
                               notebook=notebook, extra=extra, tolerances=tolerances(df, seeds))
    tex = figures.output_dir(output_dir) / f"{name}.tex"
    atomic_write(tex, lambda t: Path(t).write_text(latex(df, caption, label), encoding="utf-8"))
    return paths


# ----------------------------------------------------------------------------- verdicts

def gap(a: float, se_a: float, b: float, se_b: float, z: float = 2.0) -> dict:
    """``a - b`` of two independent accuracies, its standard error and whether it lies beyond ``z`` of them."""
    d = a - b
    se = math.sqrt(se_a ** 2 + se_b ** 2)
    return {"diff": d, "se": se, "beyond": bool(abs(d) > z * se) if math.isfinite(se) else False}


def paired_gap(a, b, tasks=ZERO_SHOT, z: float = 2.0) -> dict | None:
    r"""The gap between two rows' unweighted task-average accuracies, scored on the same examples, with the
    standard error of the paired differences: per task ``t`` with ``n_t`` examples and per-example differences
    ``d_{t,i} = x^a_{t,i} - x^b_{t,i}``, the gap is ``(1/T) sum_t mean_i d_{t,i}`` and its standard error
    ``(1/T) sqrt(sum_t var_i(d_{t,i}) / n_t)`` (sample variance, ``ddof = 1``). ``None`` when a row lacks a task's
    ``<task>_examples`` or the two were scored on different numbers of examples.

    >>> g = paired_gap({"t_examples": [1, 1, 0, 1]}, {"t_examples": [1, 0, 0, 1]}, tasks=("t",))
    >>> g["diff"], round(g["se"], 3), g["beyond"], g["paired"]
    (0.25, 0.25, False, True)
    """
    d_mean, var = [], 0.0
    for t in tasks:
        xa, xb = _examples(a, t), _examples(b, t)
        if xa is None or xb is None or len(xa) != len(xb) or len(xa) < 2:
            return None
        d = np.asarray(xa, dtype=float) - np.asarray(xb, dtype=float)
        d_mean.append(float(d.mean()))
        var += float(d.var(ddof=1)) / len(d)
    diff, se = float(np.mean(d_mean)), math.sqrt(var) / len(d_mean)
    return {"diff": diff, "se": se, "beyond": bool(abs(diff) > z * se) if se > 0 else diff != 0, "paired": True}


def _examples(row, task: str):
    x = row.get(f"{task}_examples") if hasattr(row, "get") else None
    return x if isinstance(x, (list, tuple, np.ndarray)) else None


def _row(rows: pd.DataFrame, target: float, method: str, block: str = "paper"):
    rows = _scored(rows)
    sub = rows[(rows["method"] == method) & np.isclose(rows["target"], target) & (rows["block"] == block)]
    return None if sub.empty else sub.iloc[0]


def compare(rows: pd.DataFrame, targets, ours: str = "gfwsvd", others=("fwsvd", "asvd", "svd_llm", "basis_sharing"),
            block: str = "paper", accuracy: str | None = "average", z: float = 2.0) -> list[dict]:
    """Does ``ours`` beat each of ``others`` at each target ratio? Per (ratio, other): the two PTB and
    Wikipedia perplexities (lower wins: a fixed text, no standard error) and, with ``accuracy`` (a score
    column with its ``_se``), the accuracy gap and whether it lies beyond ``z`` standard errors: for the
    zero-shot ``average`` of two rows scored on the same examples, the paired standard error
    (:func:`paired_gap`, ``acc_paired``), else that of two independent accuracies (:func:`gap`)."""
    out = []
    for target in targets:
        a = _row(rows, target, ours, block)
        for other in others:
            b = _row(rows, target, other, block)
            if a is None or b is None:
                continue
            rec = {"target": target, "ours": ours, "other": other, "block": block,
                   "ppl_ptb": bool(a["ppl_ptb"] < b["ppl_ptb"]), "ppl_wiki": bool(a["ppl_wiki"] < b["ppl_wiki"])}
            if accuracy is not None and accuracy in a and accuracy in b and not pd.isna(a[accuracy]):
                g = (paired_gap(a, b, z=z) if accuracy == "average" else None) \
                    or gap(a[accuracy], a[f"{accuracy}_se"], b[accuracy], b[f"{accuracy}_se"], z)
                rec.update({"acc_diff": g["diff"], "acc_se": g["se"], "acc_beyond_se": g["beyond"],
                            "acc_wins": bool(g["diff"] > 0), "acc_paired": bool(g.get("paired", False))})
            rec["beats"] = rec["ppl_ptb"] and rec["ppl_wiki"] and rec.get("acc_wins", True)
            out.append(rec)
    return out


def degradation(rows: pd.DataFrame, methods, block: str = "paper", text: str = "ptb") -> dict[str, float]:
    """How fast each method degrades: the least-squares slope of ``log(ppl)`` against the target ratio over
    the table's ratios where the method has scores (nats per unit ratio; ``nan`` with fewer than two)."""
    out = {}
    rows = _scored(rows)
    for m in methods:
        sub = rows[(rows["method"] == m) & (rows["block"] == block)].sort_values("target")
        x, y = sub["target"].to_numpy(float), np.log(sub[f"ppl_{text}"].to_numpy(float))
        ok = np.isfinite(y)
        out[m] = float(np.polyfit(x[ok], y[ok], 1)[0]) if ok.sum() >= 2 else float("nan")
    return out


def ablation_order(rows: pd.DataFrame, targets, order=("fwsvd", "gfwsvd_diag", "gfwsvd_offdiag", "gfwsvd"),
                   texts=("wiki", "ptb")) -> dict:
    """Does the paper's ordering hold: perplexity strictly falls along ``order`` (FWSVD > Diag > Non-diag >
    Full), per ratio and text? ``{"holds": bool, "cases": {(target, text): [ppl along order], ...}}``."""
    cases, holds = {}, True
    for target in targets:
        for text in texts:
            vals = []
            for m in order:
                sub = rows[(rows["method"] == m) & np.isclose(rows["target"], target)]
                vals.append(float(sub.iloc[0][f"ppl_{text}"]) if len(sub) else float("nan"))
            ok = all(a > b for a, b in zip(vals, vals[1:]))
            cases[f"{100 * target:g}%/{text}"] = {"ppl": vals, "holds": ok}
            holds = holds and ok
    return {"holds": holds, "cases": cases}


def collapsed(rows: pd.DataFrame, dense: dict, multiple: float) -> list[dict]:
    """The rows whose PTB or Wikipedia perplexity exceeds ``multiple`` times the dense model's."""
    out = []
    for _, r in _scored(rows).iterrows():
        worst = max(r["ppl_ptb"] / dense["ppl_ptb"], r["ppl_wiki"] / dense["ppl_wiki"])
        if worst > multiple:
            out.append({"target": float(r["target"]), "block": r["block"], "method": r["method"],
                        "allocation": r["allocation"], "x_dense": float(worst)})
    return out


def chance_level(acc: float, se: float, chance: float = CHANCE_MMLU, z: float = 2.0) -> bool:
    """True when an accuracy cannot be told from ``chance``: within ``z`` standard errors of it."""
    return bool(abs(acc - chance) <= z * se) if math.isfinite(se) else True


#: the kinds of work a decoder notebook's scores cost, as its cost line names them
COST_NAMES = {"compress": "compression", "heldout": "held-out loss", "ppl": "perplexity", "zeroshot": "zero-shot",
              "mmlu": "MMLU"}


def cost_line(first: dict[str, float], computed: dict[str, float]) -> str:
    """The verdict line of a notebook's scoring cost: ``first`` the seconds of every score it used as they were
    first measured, by kind (:func:`fisherkron.experiments.cases.first_seconds`), ``computed`` the
    seconds this run spent (``Study.timings``)."""
    total = sum(first.values())
    parts = ", ".join(f"{COST_NAMES.get(k, k)} {v / 60:.1f}" for k, v in sorted(first.items(), key=lambda kv: -kv[1]))
    return (f"* Scoring cost from empty score caches: {total / 60:.0f} min ({parts} min; each score's seconds as first "
            f"measured, on the machine and load of that run; calibration, sweeps and selection not included). "
            f"This run computed {sum(computed.values()) / 60:.1f} min of it.")
