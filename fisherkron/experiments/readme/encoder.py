"""README blocks of the encoder study (Sec. 6.2, ``make tab_glue_results``): tasks, results, verdicts, cost.

The verdict texts of ``glue_summary.verdicts`` are parsed with the patterns below; a change of their
format is an error naming the text, never a silently wrong README.
"""
from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING

from ...core.conventions import FisherkronError
from .formats import ORDINALS, and_list, cpu, dur, pct, secs, signed, span, table, word

if TYPE_CHECKING:
    from . import Outputs


# The budget for the study (no output records it): minutes from a cold cache, with cached fine-tuning.
GLUE_BUDGET_MIN = (30, 5)
# -- Sec. 6.2: encoder compression (GLUE) ------------------------------------------------
_GLUE = "tab_glue_results_summary"
_TASK_TEXT = {  # fine-tuning data, test data (numbers filled in from the record)
    "sst2": ("Rotten Tomatoes snippets minus every SST-2 validation sentence (first {train:,} of a seeded order)",
             "SST-2 validation ({test:,} of {pool:,})"),
    "boolq": ("BoolQ train ({train:,})", "BoolQ validation ({test:,} of {pool:,})"),
    "trec": ("TREC train ({train:,})", "TREC held-out split ({test:,} of {pool:,})"),
    "mrpc": ("half of the GLUE validation split ({half:,} of {pool:,}, stratified by label)",
             "the other half ({test:,})"),
    "rte": ("half of the GLUE validation split ({half:,} of {pool:,}, stratified by label)",
            "the other half ({test:,})"),
}


def _glue_tasks(out: Outputs) -> dict[str, dict]:
    tasks = {}
    for key, t in out.extra(_GLUE)["tasks"].items():
        train, dev, test = (int(x) for x in re.findall(r"\d+", t["sizes"])[:3])
        pool = re.search(r"validation split(?: ships)? \((\d+) rows\)", t["note"])
        half = re.search(r"(\d+) for training / (\d+) for test", t["note"])
        tasks[key] = dict(t, train=train, dev=dev, test=test, pool=int(pool[1]) if pool else None,
                          half=int(half[1]) if half else None)
    return tasks


def _ext(out: Outputs) -> tuple[dict, dict, dict]:
    """Columns of tab_glue_extended by task key, its reference rows (mean of the uncompressed model)."""
    from ..glue_summary import TASK_NAMES
    rows = out.table("tab_glue_extended")
    cols = {k: next(c for c in rows[0] if c.startswith(name + " (")) for k, name in TASK_NAMES.items()}
    ref = {r["method"]: r for r in rows if r["block"] == "reference"}
    dense = {k: float(str(ref["uncompressed"][c]).split(" ± ")[0]) for k, c in cols.items()}
    floor = {k: float(ref["majority class"][c]) for k, c in cols.items()}
    return cols, dense, floor


def glue_tasks(out: Outputs) -> str:
    """The tasks, splits and metrics (the record's ``tasks``, ``tab_glue_extended``'s column names)."""
    from ..glue_summary import TASK_NAMES
    tasks = _glue_tasks(out)
    cols, _, _ = _ext(out)
    body = []
    for k, t in tasks.items():
        metric = re.search(r"\((\w+)\)", cols[k])[1]
        metric = {"mcc": "MCC", "f1": "F1"}.get(metric, metric)
        yes = re.search(r"(\d+) % of the answers are 'yes'", t["metric"])
        if yes:
            metric += f" ({yes[1]} % \"yes\": the imbalanced task, CoLA's role)"
        fine, test = (s.format(**t) for s in _TASK_TEXT[k])
        body.append([TASK_NAMES[k], fine, test, metric, t["max_length"]])
    halves = [k for k, t in tasks.items() if t["half"]]
    names = " and ".join(TASK_NAMES[k] for k in halves)
    sl = lambda key: " / ".join(str(tasks[k][key]) for k in halves)  # noqa: E731
    return (table(["task", "fine-tuning data", "test data", "metric", "max tokens (test truncated)"], body) + "\n\n"
            + f"{names} ship only their validation split offline, so their scores come from {sl('test')} examples, "
            f"trained on {sl('train')} (the training half minus a dev slice of {sl('dev')}); the tables say so. "
            "Each table also carries the majority-class score of every task (the floor a collapsed model reaches).")


def _glue_means(out: Outputs) -> tuple[list[int], dict[str, dict[int, float]]]:
    rows = out.table("tab_glue_results")
    ranks = [int(c) for c in rows[0] if c != "Method / Rank"]
    means = {r["Method / Rank"]: {k: float(str(r[str(k)]).split(" ± ")[0]) for k in ranks}
             for r in rows if " ± " in str(r[str(ranks[0])])}
    return ranks, means


def glue_results(out: Outputs) -> str:
    """Tab. glue_results as the README shows it, with the uncompressed model and the majority floor."""
    rows = out.table("tab_glue_results")
    ranks = [c for c in rows[0] if c != "Method / Rank"]
    body = []
    for r in rows:
        label = r["Method / Rank"]
        if label in ("uncompressed",) or label.startswith("best"):
            continue
        label = {"compression ratio": "whole-model ratio", "GFWSVD": "**GFWSVD**", "SVD-LLM": "SVD-LLM (extra)"}.get(
            label, label)
        body.append([label] + [str(r[c]) for c in ranks])
    dense = next(r for r in rows if r["Method / Rank"] == "uncompressed")[ranks[0]]
    floor = next(r for r in out.table("tab_glue_extended") if r["method"] == "majority class")["macro avg"]
    p = out.params(_GLUE)
    return (f"**Results** (`figures/tab_glue_results.md`, `tab_glue_extended.md`, `fig_bert_glue_avg.png`; "
            f"{len(p['seeds'])} seeds, mean ± sd; {cpu(out, _GLUE)}):\n\n"
            + table(["macro average", *(f"r = {c}" if i == 0 else c for i, c in enumerate(ranks))], body)
            + f"\n\nUncompressed: {dense}; majority-class floor {floor:.3f}.")


_PER_RANK = re.compile(r"r=(\d+): (yes|no) \(closest ([\w-]+): lead ([+-][\d.]+) ± ([\d.]+) se\)")
_GROWS = re.compile(r"vs ([\w-]+): lead ([+-][\d.]+) at r in \[[^]]*\] -> ([+-][\d.]+) at r in \[[^]]*\] "
                    r"\(growth ([+-][\d.]+) ± ([\d.]+) se, (grows|does not grow)\)")
_WIN = re.compile(r"r=(\d+) \(\+([\d.]+) ± ([\d.]+) se\)")


def _parse(pattern: re.Pattern, text: str, what: str) -> list[tuple]:
    found = pattern.findall(text)
    if not found:
        raise FisherkronError(f"{_GLUE}: the {what} text no longer has the format the README renders from: {text!r}")
    return found


def _lead(mean: str, se: str) -> str:
    return f"{signed(float(mean), 3)} ± {se}"


def glue_verdicts(out: Outputs) -> str:
    """What the model learned and the three verdicts, on all tasks and on the learned ones."""
    from ..glue_summary import TASK_NAMES
    e = out.extra(_GLUE)
    v, vl, extra = e["verdicts"], e["verdicts_learned"], e["best_with_svd_llm"]
    tasks = _glue_tasks(out)
    cols, dense, floor = _ext(out)
    learned = e["learned_tasks"]
    unlearned = [k for k in tasks if k not in learned]
    ranks, means = _glue_means(out)
    metric = lambda k: {"mcc": "MCC ", "f1": "F1 "}.get(re.search(r"\((\w+)\)", cols[k])[1], "")  # noqa: E731
    stay = [f"{TASK_NAMES[k]} ({metric(k)}{dense[k]:.3f}" + (", the majority class's own score)"
                                                              if abs(dense[k] - floor[k]) < 5e-4 else ")")
            for k in unlearned]
    lines = [f"* **The uncompressed model learned only {len(learned)} of the {len(tasks)} tasks.**"]
    lines += [f"  - {TASK_NAMES[k]}: {dense[k]:.3f} against a majority-class floor of {floor[k]:.3f}." for k in learned]
    lines += [f"  - {and_list(stay)} stay at the majority class. They have "
              f"{and_list(str(tasks[k]['train']) for k in unlearned)} fine-tuning examples offline, which is too "
              "little for MiniLM.",
              f"  - So {len(unlearned)} of the {len(tasks)} columns of the macro average are noise, and the verdicts "
              f"are repeated on the {len(learned)} learned tasks."]
    # (1) best at each rank
    per = {int(r): (ok, who, m, se) for r, ok, who, m, se in _parse(_PER_RANK, v["best"]["text"], "best")}
    per_l = {int(r): (ok, who, m, se) for r, ok, who, m, se in _parse(_PER_RANK, vl["best"]["text"], "best")}
    # the clearest lead: the largest lower bound mean - 2 se
    clear = max((r for r in per if per[r][0] == "yes"), key=lambda r: float(per[r][2]) - 2 * float(per[r][3]))
    ok, who, m, se = per[clear]
    l_ok, l_who, l_m, l_se = per_l[clear]
    lines += [f"* **(1) Best at each rank: {v['best']['verdict']}.**",
              f"  - GFWSVD is best or tied at {v['best']['ranks_ok']} of {v['best']['ranks']} ranks. Its clearest "
              f"lead is at r = {clear}: {_lead(m, se)} se over {who} on {len(tasks)} tasks, {_lead(l_m, l_se)}"
              + (f" over {l_who}" if l_who != who else "") + f" on the {len(learned)} learned tasks."]
    for r in (r for r in ranks if per[r][0] == "no"):
        order = sorted(means, key=lambda k: -means[k][r])
        place = "last" if order[-1] == "GFWSVD" else ORDINALS[order.index("GFWSVD")]
        lines.append(f"  - At r = {r} it is {place}: {_lead(per[r][2], per[r][3])} against {per[r][1]}.")
    ahead = sum(means["SVD-LLM"][r] > means["GFWSVD"][r] for r in ranks)
    px = {int(r): (ok, who, float(m)) for r, ok, who, m, se in _parse(_PER_RANK, extra["text"], "SVD-LLM")}
    worst = min((r for r in px if px[r][0] == "no"), key=lambda r: px[r][2], default=None)
    lines.append(f"  - SVD-LLM, our extra column, has the higher mean at {ahead} of {len(ranks)} ranks. With it among "
                 f"the rivals, GFWSVD is best or tied at only {extra['ranks_ok']} of {extra['ranks']}"
                 + (f" (r = {worst}: {means['SVD-LLM'][worst]:.3f} against {means['GFWSVD'][worst]:.3f})."
                    if worst is not None else "."))
    # (2) the lead grows at low rank
    lines.append(f"* **(2) The lead grows at low rank: {v['lead_grows']['verdict']}.**")
    grow_l = {b: (hi, lo) for b, hi, lo, *_ in _parse(_GROWS, vl["lead_grows"]["text"], "lead_grows")}
    for b, hi, lo, g, gse, state in _parse(_GROWS, v["lead_grows"]["text"], "lead_grows"):
        verb = "grows" if state == "grows" else "does not grow"
        lines.append(f"  - Over {b} it {verb}: from {signed(float(hi), 3)} to {signed(float(lo), 3)} (growth "
                     f"{_lead(g, gse)} se). On the learned tasks: from {signed(float(grow_l[b][0]), 3)} to "
                     f"{signed(float(grow_l[b][1]), 3)}.")
    lead = {r: means["GFWSVD"][r] - means["FWSVD"][r] for r in ranks}  # ranks in falling order
    mono = all(lead[a] <= lead[b] for a, b in zip(ranks, ranks[1:]))
    peak = max(ranks, key=lambda r: lead[r])
    lines.append(f"  - The growth is {'monotone' if mono else 'not monotone'}: the lead over FWSVD (table means) is "
                 f"largest at r = {peak} ({signed(lead[peak], 3)}) and {signed(lead[ranks[-1]], 3)} at "
                 f"r = {ranks[-1]}.")
    # (3) ASVD
    a = v["asvd"]
    wins = _WIN.findall(" ".join(a["wins"]))
    lines += [f"* **(3) ASVD collapses and wins on SST-2: {a['verdict']}.**",
              "  - ASVD collapses on " + ("; ".join(a["collapsed"]) if a["collapsed"] else "no task we can judge")
              + ". The paper's collapses are on QQP and QNLI, which do not ship offline, and the "
              f"{word(len(unlearned))} unlearned tasks cannot show a collapse.",
              "  - " + ("; ".join(f"ASVD beats GFWSVD on SST-2 at r = {r} by +{m} ± {se} se" for r, m, se in wins)
                        + ", as the paper reports." if wins else
                        "ASVD does not beat GFWSVD on SST-2 at the lowest ranks.")]
    return "\n".join(lines)


def glue_cost(out: Outputs) -> str:
    """The study's cost from the recorded times of its runs, against the issue's budget."""
    e, p = out.extra(_GLUE), out.params(_GLUE)
    runs = e["runs"]
    pairs = {(r["task"], r["seed"]) for r in runs}
    work = sum(r.get("compress_seconds", 0) + r.get("eval_seconds", 0) for r in runs)
    calib = sum({(r["task"], r["seed"]): r["calibration_seconds"]  # one collection per (task, seed)
                 for r in runs if r.get("calibration_seconds")}.values())
    search = e["lr_search"]
    train = sum(x["train_seconds"] for x in search)
    per_task = len({x["lr"] for x in search}) + len(p["seeds"]) - 1  # the search's winner is seed 0's model
    n_more = len(p["tasks"]) * (len(p["seeds"]) - 1)
    finetune = train * per_task / len({x["lr"] for x in search})
    cached = (work + calib) / 60
    cold = cached + finetune / 60
    gf = {}
    for r in runs:
        if r["method"] == "gfwsvd":
            gf[r["task"], r["seed"]] = gf.get((r["task"], r["seed"]), 0) + r["compress_seconds"]
    met = cold <= GLUE_BUDGET_MIN[0] and cached <= GLUE_BUDGET_MIN[1]
    return "\n".join([
        f"**Cost, against the issue's budget ({'met' if met else 'missed'}).** The committed outputs come from a "
        f"run of {secs(out.wall(_GLUE))} (provenance `wall_seconds`), which read from the cache whatever earlier, "
        "interrupted runs had stored. The summary record keeps the recorded time of all the work, cached or not:",
        f"* The compression and scoring of the {len(pairs)} (task, seed) pairs took {dur(work)}, and collecting "
        f"their calibration gradients {dur(calib)}. These are sums of recorded "
        "times, some of them measured while other studies shared the cores.",
        f"* Fine-tuning: the {len(search)} learning-rate runs recorded {dur(train)} of training; "
        f"with the {n_more} further seeds at the same cost per run, about {secs(finetune)} in all.",
        f"* So a cold cache takes about {secs(cold * 60)} against a budget of {GLUE_BUDGET_MIN[0]} min, and a cached "
        f"fine-tuning about {secs(cached * 60)} against {GLUE_BUDGET_MIN[1]}.",
        f"* The cost is dominated by GFWSVD's MFF at k = {p['k']} ({span(gf.values(), lambda s: f'{s:.0f}')} s per "
        f"pair) and by scoring {sum(r['method'] != 'dense' for r in runs)} compressed models.",
        "* Every fine-tuned model and every scored case is cached, so an interrupted run resumes, and a second "
        "`make tab_glue_results` does nothing."])


def glue_ffn_share(out: Outputs) -> str:
    """The compressed layers' share of MiniLM's weights (inline): whole-model ratio / layers' ratio of a run."""
    runs = [r for r in out.extra(_GLUE)["runs"] if r.get("layers_ratio")]
    return pct(statistics.median(r["ratio"] / r["layers_ratio"] for r in runs))


BLOCKS = {"glue-ffn-share": glue_ffn_share, "glue-tasks": glue_tasks, "glue-results": glue_results, "glue-verdicts": glue_verdicts,
          "glue-cost": glue_cost}
