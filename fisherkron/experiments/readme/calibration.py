"""README blocks of the calibration study (``make fig_calibration``): perplexity against k and granularity,
the verdicts and the cost against the issue's target.
"""
from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING

from .formats import and_list, bold, cores, cpu, method_name, num, pct, sci, secs, table

if TYPE_CHECKING:
    from . import Outputs


#: the target at k = 32: minutes, GB of RAM, GB of disk (the notebook's target_* parameters, which the
#: committed run's record predates)
CAL_TARGETS = {"target_minutes": 15.0, "target_ram_gb": 12.0, "target_disk_gb": 8.0}

# -- calibration at scale -------------------------------------------------------------------
_CAL = "fig_calibration_summary"


def _cal(out: Outputs) -> dict[tuple, dict]:
    return {(r["setting"], r["method"], round(r["target_ratio"], 4)): r for r in out.table("tab_calibration")}


def calibration_running(out: Outputs) -> str:
    """How the committed run was made: its wall time and machine, and whether it measured its cost table itself
    (a run shorter than half of what its cost table adds up to must have read the measurements from its cache)."""
    wall = out.wall(_CAL)
    costs = 60 * sum(r["total_min"] for r in out.table("tab_calibration_cost"))
    how = (f"that read its measurements from the cache (its cost table adds up to {secs(costs)}); from a cold cache "
           "it collects every setting of the cost table below itself" if wall < 0.5 * costs else
           f"that collected every setting of its cost table itself ({secs(costs)} of the run)")
    return (f"* **Running it:** the notebook `notebooks/fig_calibration.py`; the committed outputs come from a run of "
            f"{secs(wall)} on the {cpu(out, _CAL)} (provenance `wall_seconds`) {how}. Outputs:\n"
            "  [table](figures/tab_calibration.md), [cost](figures/tab_calibration_cost.md),\n"
            "  `figures/fig_calibration.png`.")


def calibration_ppl(out: Outputs) -> str:
    """PTB perplexity against k and granularity (``tab_calibration``); bold: the lowest at each ratio."""
    c, p = _cal(out), out.params(_CAL)
    cost = {r["setting"]: r for r in out.table("tab_calibration_cost")}
    methods, ratios = p["methods"], [round(q, 4) for q in p["ratios"]]
    dense = next(iter(c.values()))
    dense = dense["ppl_ptb"] / dense["ptb_x_dense"]
    best = {q: min(r["ppl_ptb"] for (_, _, qq), r in c.items() if qq == q) for q in ratios}
    settings = list(dict.fromkeys(s for (s, _, _) in c))
    body = []
    for s in settings:
        any_row = next(r for (ss, _, _), r in c.items() if ss == s)
        k, gran, grads = int(any_row["k"]), any_row["granularity"], int(any_row["gradients"])
        label = (f"{k} ({num(cost[s]['tokens'])})" if gran == "batch" else
                 f"{k}, one gradient per {gran} ({num(grads)})")
        cells = [" / ".join(bold(num(c[s, m, q]["ppl_ptb"]), c[s, m, q]["ppl_ptb"] == best[q]) for q in ratios)
                 if (s, m, ratios[0]) in c else "" for m in methods]
        body.append([label, *cells])
    rr = " / ".join(pct(q) for q in ratios)
    return (f"PTB perplexity (uncompressed {num(dense, 1)}; bold: the lowest at each ratio):\n\n"
            + table(["k (tokens)", *(f"{method_name(m)} {rr}" for m in methods)], body))


def calibration_verdicts(out: Outputs) -> str:
    """k, granularity, 16-bit gradients and the K-FAC warm start, from the summary's ``verdict``."""
    c, e, p = _cal(out), out.extra(_CAL), out.params(_CAL)
    v = e["verdict"]
    ks = sorted(p["ks"])
    kmin, kmax = ks[0], ks[-1]
    q1, q2 = (round(q, 4) for q in p["ratios"][:2])
    s = lambda k: f"k{k}-batch-{p['grad_dtype']}"  # noqa: E731
    ppl = lambda k, m, q: c[s(k), m, q]["ppl_ptb"]  # noqa: E731
    gain = {m: ppl(kmin, m, q1) / ppl(kmax, m, q1) for m in p["methods"]}
    most = max(gain, key=gain.get) == "gfwsvd"
    over = [v[f"{q:.2f}"]["gfwsvd_overtakes_kfac_at_kmax"] for q in (q1, q2)]
    trend = {q: ppl(kmax, "gfwsvd", q) / ppl(kmax, "kfac_svd", q) < ppl(kmin, "gfwsvd", q) / ppl(kmin, "kfac_svd", q)
             for q in (q1, q2)}
    g20 = [ppl(k, "gfwsvd", q2) for k in ks]
    mono = all(a >= b for a, b in zip(g20, g20[1:]))
    bump = ks[max(range(len(ks)), key=lambda i: g20[i])]
    gq = {q: v[f"granularity_{q:.2f}"] for q in (q1, q2)}
    order = lambda q: ", then ".join(f"per {k} ({num(gq[q]['ppl'][k])})"  # noqa: E731
                                     for k in sorted(gq[q]["ppl"], key=gq[q]["ppl"].get))
    tokens = next(r for r in out.table("tab_calibration_cost") if r["setting"] == s(p["granularity_k"]))["tokens"]
    enc = {}
    for r in e["encoding"]:
        enc.setdefault(r["encoding"], []).append(r["rel_error"])
    w = v["warm_start"]
    gap = lambda q, key: num(v[f"{q:.2f}"][key], 2 if v[f"{q:.2f}"][key] < 10 else 1)  # noqa: E731
    lines = [
        f"* **MFF {'improves the most' if most else 'does not improve the most'} with k, "
        f"{'and overtakes' if all(over) else 'but does not overtake'} K-FAC by k = {kmax}.**",
        f"  - At {pct(q1)}, GFWSVD goes from {num(ppl(kmin, 'gfwsvd', q1))} to {num(ppl(kmax, 'gfwsvd', q1))} "
        f"({num(gain['gfwsvd'], 1)}×) between k = {kmin} and k = {kmax}. KFAC-SVD goes from "
        f"{num(ppl(kmin, 'kfac_svd', q1))} to {num(ppl(kmax, 'kfac_svd', q1))} and SVD-LLM from "
        f"{num(ppl(kmin, 'svd_llm', q1))} to {num(ppl(kmax, 'svd_llm', q1))}.",
        f"  - The gap to SVD-LLM goes from {gap(q1, 'gap_to_svd_llm_kmin')}× to {gap(q1, 'gap_to_svd_llm_kmax')}× at "
        f"{pct(q1)}, and from {gap(q2, 'gap_to_svd_llm_kmin')}× to {gap(q2, 'gap_to_svd_llm_kmax')}× at {pct(q2)}.",
        f"  - {'MFF' if all(over) else 'K-FAC'}'s factors {'overtake' if all(over) else 'stay ahead'} at k = {kmax}: "
        f"KFAC-SVD {num(ppl(kmax, 'kfac_svd', q1))} / {num(ppl(kmax, 'kfac_svd', q2))} against GFWSVD "
        f"{num(ppl(kmax, 'gfwsvd', q1))} / {num(ppl(kmax, 'gfwsvd', q2))}.",
        (f"  - At {pct(q2)} the GFWSVD curve is monotone in k." if mono else
         f"  - At {pct(q2)} the GFWSVD curve is not monotone ({num(ppl(bump, 'gfwsvd', q2))} at k = {bump}). The "
         "`fisher` allocation moves many ranks when MFF's factors change; the allocation issue's caveats apply."),
        "  - Whether MFF overtakes K-FAC at the paper's larger k is not measured. "
        + " and ".join(f"the trend at {pct(q)} {'points that way' if trend[q] else 'does not'}" for q in (q1, q2))
        .capitalize() + ".",
        f"* **Granularity, with the same {num(tokens)} tokens:**",
        *(f"  - At {pct(q)}, {order(q)}." for q in (q1, q2)),
        ("  - No granularity wins at both ratios, so the default stays the paper's, per batch."
         if gq[q1]["best"] != gq[q2]["best"] else
         f"  - Per {gq[q1]['best']} wins at both ratios."),
        f"* **16-bit gradients.** At k = {p['encoding_k']}, on the {len(e['encoding']) // len(enc)} layers of blocks "
        f"{and_list(_blocks(p['encoding_layers']))}, the relative error of MFF's `A ⊗ B` against "
        "float32 gradients is:",
        *(f"  - {name}{' with a per-gradient scale' if name == 'float16' else ''}: median "
          f"{sci(statistics.median(x))}." for name, x in enc.items()),
        "",
        f"  Both are far below the sampling noise of a {p['encoding_k']}-gradient Fisher. bfloat16 halves the disk.",
        f"* **K-FAC warm start: it {'pays' if w['pays'] else 'does not pay'}.**",
        f"  - On the {w['layers']} layers of blocks {and_list(_blocks(p['warm_layers']))} at k = {kmax}, MFF from "
        f"K-FAC used {w['matvecs_kfac']} products ({w['seconds_kfac']:.0f} s) and MFF from "
        f"the identity used {w['matvecs_identity']} ({w['seconds_identity']:.0f} s).",
        f"  - Collecting K-FAC's statistics costs about {num(w['kfac_collection_seconds_per_batch'], 1)} s per batch "
        f"({num(w['paid_seconds'])} s at k = {kmax}).",
        "  - GFWSVD's default already skips them: `collect_calibration(methods=(\"gfwsvd\",))` collects only the "
        f"gradients, and MFF starts from the identity. It {'stays' if not w['pays'] else 'should not stay'} the "
        "default."]
    return "\n".join(lines)


def _timed(e2e: list[dict], idle: float) -> str:
    """What the target's timings were taken on: idle cores, shared ones (an upper bound), or not recorded."""
    shares = [x.get("others_cpu_share") for x in e2e]
    if any(s is None for s in shares):
        return " (whether the cores were idle was not recorded)"
    if all(s < idle for s in shares):
        return ", timed on otherwise idle cores"
    return (f", timed with other processes using up to {pct(max(shares))} of the cores, so these times are upper "
            "bounds")


def _blocks(pattern: str) -> list[str]:
    """The block numbers a layer pattern such as ``model\\.layers\\.(0|15|29)\\..*`` selects."""
    return re.findall(r"\d+", pattern)


def calibration_cost(out: Outputs) -> str:
    """The cost table (``tab_calibration_cost``) against the target, and where the disk goes."""
    e, p = out.extra(_CAL), {**CAL_TARGETS, **out.params(_CAL)}
    rows = out.table("tab_calibration_cost")
    idle = p.get("idle_share", 0.1)
    end2end = {round(r["minutes"], 6) for r in e["verdict"]["end2end"]}
    body = []
    for r in sorted(rows, key=lambda r: "collection only" in r["setting"]):  # the collection-only row last
        setting = r["setting"]
        k = int(re.match(r"k(\d+)", setting)[1])
        if "-batch-" not in setting:
            continue
        if "GFWSVD only" in setting:
            label = f"k = {k}, GFWSVD's default (gradients only, MFF from the identity)"
        elif "collection only" in setting:
            label = f"k = {k}, collection only"
        elif r["compress_s"] is not None:
            label = f"k = {k}, the three methods' statistics"
        else:
            label = f"k = {k}"
        mff = f"{r['mff_s']:.0f} s ({r['mff_gflops_per_s']:.0f} GFLOP/s)" if r["mff_s"] is not None else ""
        body.append([label, f"{r['collect_s']:.0f} s ({r['tokens_per_s']:.0f} tok/s)", mff,
                     f"{r['compress_s']:.0f} s" if r["compress_s"] is not None else "",
                     bold(f"{r['total_min']:.1f} min", round(r["total_min"], 6) in end2end),
                     f"{r['peak_rss_gb']:.1f} GB", f"{r['disk_gb']:.1f} GB", cores(r.get("others_load"), idle)])
    e2e = e["verdict"]["end2end"]
    full = next(x for x in e2e if "three" in x["setting"])
    default = next(x for x in e2e if "default" in x["setting"])
    kmax = p["end2end_k"]
    full_row = next(r for r in rows if r["setting"] == f"k{kmax}-batch-{p['grad_dtype']}")
    peak = out.extra("tab_time_algo")["gemm_peak_gflops"]
    same_machine = cpu(out, "tab_time_algo") == cpu(out, "tab_calibration_cost")
    # disk on the default path: the bfloat16 gradients and the float64 MFF factors (m^2 + n^2 per layer)
    shapes = [(r["n"], r["m"]) for r in out.table("tab_singular_values_layers") if r["model"] == "smollm2"]
    grads_gb = kmax * sum(n * m for n, m in shapes) * 2 / 1e9
    factors_gb = sum(n * n + m * m for n, m in shapes) * 8 / 1e9
    def verdict(key: str) -> str:
        met = [x["met"][key] for x in e2e]
        return "met" if all(met) else "missed" if not any(met) else "met in part"

    return "\n".join([
        f"* **Cost, against the target at k = {kmax}** ({p['target_minutes']:g} min, {p['target_ram_gb']:g} GB RAM, "
        f"{p['target_disk_gb']:g} GB disk):",
        "",
        table(["setting", "collection", f"MFF, {len(shapes)} layers", "GFWSVD", "total", "peak RSS", "disk",
               "cores"], body),
        "",
        f"  - MFF's products run at {full_row['mff_gflops_per_s']:.0f} GFLOP/s at k = {kmax}, against {peak:.0f} "
        + ("for this VM type's float32 GEMM (the runtime study's peak)." if same_machine else
           f"for the float32 GEMM of the {cpu(out, 'tab_time_algo')} that ran the runtime study: another "
           "machine, so the two do not compare (the GEMM peak differs between VM types)."),
        f"  - **Time: {verdict('time')}**, with {num(full['minutes'], 1)} min for the three methods' statistics and "
        f"{num(default['minutes'], 1)} min on GFWSVD's default path{_timed(e2e, idle)}.",
        f"  - **RAM: {verdict('ram')}** ({num(full['peak_gb'], 1)} GB and {num(default['peak_gb'], 1)} GB). Peak RSS "
        "counts the pages of the memory-mapped gradient files, so it grows with k.",
        f"  - **Disk: {verdict('disk')}**{', even on the default path' if not default['met']['disk'] else ''}: "
        f"{num(default['disk_gb'], 1)} GB, which is {num(grads_gb, 1)} GB of bfloat16 gradients and "
        f"{num(factors_gb, 1)} GB of cached MFF factors (`m² + n²` float64 values per layer, more than `n m` for "
        f"SmolLM2's shapes). The three methods' statistics add about {num(full['disk_gb'] - default['disk_gb'], 1)} "
        f"GB of float64 `X Xᵀ` / `δ δᵀ` sums ({num(full['disk_gb'], 1)} GB).",
        f"  - Two changes would fit {p['target_disk_gb']:g} GB, neither made here:",
        "    - keep the Gram sums in float32, once per shared input (q/k/v and gate/up read the same `X`);",
        "    - keep the factors' triangles.",
        "",
        "    Both change the calibration format, which is part of every cache key, so they would recompute every "
        "cached study."])


BLOCKS = {"calibration-running": calibration_running, "calibration-ppl": calibration_ppl,
          "calibration-verdicts": calibration_verdicts, "calibration-cost": calibration_cost}
