"""README blocks of the SmolLM2 studies: FLOPs and speed (App. F, ``make tab_throughput``) and the per-layer
rank allocation (Sec. 6.3 protocol, ``make fig_rank_allocation``).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ...core.conventions import FisherkronError
from .formats import ORDINALS, bold, cpu, factor, method_name, num, pct, perplexity, secs, span, table, word

if TYPE_CHECKING:
    from . import Outputs


# -- App. F: FLOPs and speed -------------------------------------------------------------
_THR = "tab_throughput_summary"


def _ratio_rows(rows: list[dict], key: str = "target ratio") -> list[dict]:
    return [r for r in rows if str(r[key]).endswith("%") and "keep dense" not in str(r[key])
            and r[key] != "0%"]


def throughput(out: Outputs) -> str:
    """App. F: FLOPs, prefill and decoding speed, ``min_speedup`` (the throughput tables and summary)."""
    v, p = out.extra(_THR)["verdict"], out.params(_THR)
    flops = out.table("tab_flops_comparison")
    ours = [r for r in flops if r["model"] == p["model_name"]]
    llama = [r for r in flops if r["model"] == p["extra_flops_model"]]
    top = max(ours, key=lambda r: r["target ratio"])
    l0 = next(r for r in llama if r["target ratio"] == 0)
    ltop = max(llama, key=lambda r: r["target ratio"])
    fw = out.table("tab_throughput_fwsvd")
    pre = _ratio_rows(fw)
    last = pre[-1]
    paper = [r["paper speedup"] for r in pre if r["paper speedup"] is not None]
    fwd = out.table("tab_throughput_forward")
    dec = {b: [r["speedup"] for r in _ratio_rows(fwd) if r["batch"] == b] for b in p["decode_batches"]}
    pdec = {b: [r for r in fwd if r["batch"] == b] for b in p["decode_batches"]}
    ms = "paper ms per token (1024 context)"
    paper_dec = [next(r for r in pdec[b] if r["target ratio"] == "0%")[ms]
                 / next(r for r in pdec[b] if r["target ratio"] == last["target ratio"])[ms]
                 for b in p["decode_batches"]]
    layers = out.table("tab_throughput_layers")
    tok = sorted({int(r["tokens"]) for r in layers})
    shapes = {(r["n"], r["m"]): r["layers"] for r in layers if r["ratio"] == layers[0]["ratio"]}
    n_layers = int(sum(shapes.values()))
    slow = [r for r in layers if r["slower"]]
    big = max(tok)
    slow_big = [r for r in slow if r["tokens"] == big]
    few = f"{min(tok)}-{sorted(tok)[-2]}" if len(tok) > 2 else str(min(tok))
    kd = {r["target_ratio"]: r for r in v["keep_dense"]}
    all_fact = {r["target ratio"]: r for r in fw}
    keep = []
    for t, r in sorted(kd.items()):
        base = all_fact[f"{round(100 * t)}%"]
        if r["dense_layers"]:
            keep.append(f"at {pct(t)} it keeps {r['dense_layers']} of {n_layers} layers dense (the ratio falls to "
                        f"{pct(r['ratio'], 1)}) and runs at {num(r['forward_speedup'], 2)}× instead of "
                        f"{num(base['speedup'], 2)}×")
        else:
            keep.append(f"at {pct(t)} it keeps none dense: the same model, timed again at "
                        f"{num(r['forward_speedup'], 2)}× against {num(base['speedup'], 2)}×")
    decode_label = ("Decoding does not speed up on this CPU" if max(max(s) for s in dec.values()) < 1.1
                    else "Decoding speeds up less than prefill")
    return "\n".join([
        f"* **FLOPs:** the analytic count {'equals' if all(r['equal'] for r in flops) else 'does not always equal'} "
        f"`FlopCounterMode` on every row. At {pct(top['params removed'])} of the parameters removed the forward pass "
        f"keeps {pct(top['FLOPs / dense'])} of its FLOPs (the LM head and attention are not compressed). "
        f"Llama-2-7B-chat at {num(out.params('tab_flops_comparison')['flop_seq_len'])} tokens, counted from its "
        "config: "
        f"{num(l0['TFLOPs (analytic)'], 1)} TFLOPs against the paper's {l0['paper TFLOPs']:g} "
        f"({num(l0['paper TFLOPs'] / l0['TFLOPs (analytic)'], 1)}×; the paper does not say how it counted), "
        f"{num(ltop['FLOPs / dense'], 2)} of dense at {pct(ltop['target ratio'])} against the paper's "
        f"{num(ltop['paper FLOPs / dense'], 2)}.",
        f"* **Prefill (batch {p['forward_batch']} × {num(p['forward_seq_len'])} tokens): "
        f"{'holds' if v['target_met'] else 'does not hold'}.** "
        + ", ".join(f"{num(r['speedup'], 2)}× at {r['target ratio'].replace('%', ' %')}" for r in pre)
        + f" (paper, FWSVD on Llama-2-7B: {num(min(paper), 2)}× to {num(max(paper), 2)}×); at "
        f"{pct(v['largest_ratio'])} the measured speedup is {num(v['efficiency'], 2)} of the FLOP speedup "
        f"(target ≥ {p['target']:g}: {'met' if v['target_met'] else 'missed'}).",
        f"* **{decode_label}:** one step with {p['decode_context']} cached tokens at batch "
        + " and at batch ".join(f"{b}{' runs' if i == 0 else ''} at {span(dec[b], lambda x: num(x, 2))}×"
                                + (" the dense speed" if i == 0 else "")
                                for i, b in enumerate(p["decode_batches"]))
        + f" (paper, A100 at {pct(v['largest_ratio'])}: " + " and ".join(f"{num(x, 2)}×" for x in paper_dec)
        + f"): with {few} rows, two thin GEMMs cost more than one dense GEMM. {len(slow)} of {len(layers)} (shape, "
        f"rank, rows) cases are slower factorised than dense: {len(slow) - len(slow_big)} at {few} rows, "
        f"{len(slow_big)} at {num(big)} rows, all of those at "
        f"{span([r['ratio'] for r in slow_big], lambda x: num(100 * x))} % of the parameters removed (near the "
        "break-even rank).",
        f"* `compress(..., min_speedup={p['min_speedup']})` keeps those layers dense: " + "; ".join(keep) + "."])



# -- Sec. 6.3 protocol: rank allocation ----------------------------------------------------
_RA = "fig_rank_allocation_summary"
_RA_ROWS = [  # (method, the allocations in one row, label); a row of several shows "a / b / c"
    ("gfwsvd", ("uniform",), "uniform"), ("gfwsvd", ("sensitivity",), "sensitivity (the paper's)"),
    ("gfwsvd", ("fisher",), "fisher"), ("kfac_svd", ("uniform",), "uniform"), ("kfac_svd", ("fisher",), "fisher"),
    ("svd_llm", ("uniform",), "uniform (its own)"), ("svd_llm", ("fisher",), "fisher"),
    ("asvd", ("uniform", "sensitivity", "fisher"), "uniform / sensitivity (its own) / fisher"),
    ("fwsvd", ("uniform", "fisher"), "uniform / fisher"), ("svd", ("uniform", "fisher"), "uniform / fisher")]


def _ra(out: Outputs) -> dict[tuple[str, str, float], dict]:
    return {(r["method"], r["strategy"], round(r["target_ratio"], 4)): r for r in out.table("tab_rank_allocation")}


def _best(t: dict, method: str, ratio: float) -> dict:
    return min((r for (m, s, q), r in t.items() if m == method and q == ratio and s != "uniform"),
               key=lambda r: r["ppl_ptb"])


def rank_allocation_setup(out: Outputs) -> str:
    """The study's protocol, from its parameters, table and wall time."""
    p, t = out.params(_RA), _ra(out)
    evals = max(r["allocation_evaluations"] for r in t.values())
    return (f"SmolLM2 (4-bit-quantised weights, dequantised), calibration k = {p['k']} batches of {p['batch_size']} × "
            f"{p['seq_len']} tokens from the first {p['calib_docs']} C4 documents; the sensitivity sweep measures the "
            f"loss on {word(p['heldout_k'])} held-out batch{'es' * (p['heldout_k'] != 1)} of {p['batch_size']} × "
            f"{p['seq_len']} tokens from the other C4 documents at per-layer ratios "
            f"{' / '.join(f'{x:g}' for x in p['sens_ratios'])} ({evals:.0f} evaluations per method); perplexity on the "
            f"first {num(p['eval_tokens'])} tokens of PTB test and of the Wikipedia text, {p['eval_seq_len']}-token "
            "windows. Nothing the allocations see comes from the evaluation texts. "
            f"{len(t)} compressed models, {_ra_run(out, t)}. [Table](figures/tab_rank_allocation.md), figures\n"
            "[`fig_rank_allocation`](figures/fig_rank_allocation.png) and\n"
            "[`fig_rank_allocation_validation`](figures/fig_rank_allocation_validation.png).")


def _ra_run(out: Outputs, t: dict) -> str:
    """How long the committed run took, and whether it computed its cases or read them from the cache.

    The cases' own compression times add up to more than a run that read them all from the cache
    takes; a run shorter than half of that sum cannot have computed them.
    """
    wall, compress = out.wall(_RA), sum(r["compress_seconds"] for r in t.values())
    where = f"{secs(wall)} on the {cpu(out, _RA)} (provenance `wall_seconds`"
    if wall < compress / 2:
        return (f"{where}) for the committed run, which read its cases from the cache (their compression alone "
                f"took {secs(compress)} when they were computed)")
    return f"{where}; the record does not say whether other work shared the cores)"


def rank_allocation(out: Outputs) -> str:
    """PTB perplexity per method, allocation and ratio (``tab_rank_allocation``); bold: the lowest at each ratio."""
    t, v = _ra(out), out.extra(_RA)["verdict"]
    ratios = sorted({q for (_, _, q) in t})
    best = {q: min(r["ppl_ptb"] for (_, _, qq), r in t.items() if qq == q) for q in ratios}
    body = []
    for method, strategies, label in _RA_ROWS:
        cells = []
        for q in ratios:
            vals = [t.get((method, s, q)) for s in strategies]
            cells.append("" if not any(vals) else " / ".join(
                bold(perplexity(r["ppl_ptb"]), r["ppl_ptb"] == best[q]) if r else "–" for r in vals))
        body.append([method_name(method), label, *cells])
    return (f"PTB perplexity (uncompressed **{num(v['dense_ppl_ptb'], 1)}**; bold: the lowest at each ratio):\n\n"
            + table(["method", "allocation", *(pct(q) for q in ratios)], body))


def rank_allocation_verdicts(out: Outputs) -> str:
    """The study's verdicts, from its table and summary record."""
    t, v, p = _ra(out), out.extra(_RA)["verdict"], out.params(_RA)
    methods = sorted({m for (m, _, _) in t})
    lines = ["Verdicts (from these numbers and the notebook's summary record):", ""]
    gains, bests = [], []
    for q in p["other_ratios"]:
        gain = {m: t[m, "uniform", q]["ppl_ptb"] / _best(t, m, q)["ppl_ptb"] for m in methods}
        lo, hi = min(gain, key=gain.get), max(gain, key=gain.get)
        gains.append(f"at {pct(q)} from {factor(gain[lo])}× ({method_name(lo)}) to {factor(gain[hi])}× "
                     f"({method_name(hi)})")
        bests.append(f"at {pct(q)} " + ", ".join(f"{method_name(m)} {num(_best(t, m, q)['ppl_ptb'])}"
                                                 for m in v[f"ranking_{round(100 * q)}"]))
    lines.append("* **Allocation matters more than the method.** Every method gains over a uniform ratio, "
                 + " and ".join(gains) + ". Each method's best allocation, " + "; ".join(bests) + ".")
    g = {q: t["gfwsvd", "sensitivity", q] for q in p["other_ratios"]}
    f = {q: t["gfwsvd", "fisher", q] for q in p["other_ratios"]}
    q1, q2 = p["other_ratios"][:2]
    # the committed run's parameters predate target_10 / target_20: its summary lines state them
    stated = {round(int(a) / 100, 4): float(b) for a, b in
              re.findall(r"GFWSVD at (\d+)%, best allocation.*?target ([\d.]+)x", " ".join(out.extra(_RA)["lines"]))}
    targets = {q: p.get(f"target_{round(100 * q)}", stated.get(q)) for q in (q1, q2)}
    if None in targets.values():
        raise FisherkronError(f"{_RA}: no target for GFWSVD at {q1:g} / {q2:g} in its parameters or lines")
    met = [g[q]["ptb_x_dense"] <= targets[q] for q in (q1, q2)]
    lines.append(f"* **Targets {'met' if all(met) else 'missed' if not any(met) else 'met in part'}.** GFWSVD's best "
                 f"(the sensitivity allocation) is " + " and ".join(
                     f"{num(g[q]['ptb_x_dense'], 1)}×{' the uncompressed perplexity' if q == q1 else ''} at {pct(q)} "
                     f"(target {targets[q]:g}×)" for q in (q1, q2)) + ".")
    worse = all(f[q]["ppl_ptb"] > g[q]["ppl_ptb"] for q in (q1, q2))
    n_val = p["validation_layers"] * len(p["validation_ratios"])
    lines.append(f"* **The Fisher-predicted allocation {'does not match' if worse else 'matches'} the measured one for "
                 "GFWSVD** (" + ", ".join(f"{num(f[q]['ppl_ptb'])} against {num(g[q]['ppl_ptb'])} at {pct(q)}"
                                          for q in (q1, q2))
                 + f"), although it needs no model evaluation where the sweep needed "
                 f"{g[q1]['allocation_evaluations']:.0f} ({num(g[q1]['sweep_seconds'])} s: the table's "
                 f"`sweep_seconds`; the allocation step that read the cached sweep took "
                 f"{num(g[q1]['allocation_seconds'], 1)} s). Theorem 1's prediction orders single-layer compressions "
                 f"with Spearman {num(v['spearman_per_layer'], 2)} ({n_val} points) but whole allocations with "
                 f"{num(v['spearman_whole'], 2)}: with k = {v['k']} batch gradients, the predicted increases of "
                 "different layer types are not on the scale of the measured ones (the Fisher allocation compresses "
                 "the large MLP layers, the measured sweep finds the attention `q_proj` / `k_proj` the least "
                 "sensitive). One reason, from the spectrum study: MFF's one Kronecker term holds a median "
                 + _spectrum_shares(out) + ", so the MLP layers' predicted increases are the least complete.")
    rank = {q: v[f"ranking_{round(100 * q)}"] for q in (q1, q2)}
    ahead = all(rank[q][0] == "gfwsvd" for q in (q1, q2))
    def lead(q: float, n: int) -> str:
        return " and ".join(f"{method_name(m)} ({num(_best(t, m, q)['ppl_ptb'])})" for m in rank[q][:n])

    lines.append(f"* **The paper's ordering {'holds' if ahead else 'does not hold at this scale'}**: GFWSVD is "
                 f"{'ahead' if ahead else 'not ahead'}. At {pct(q1)} {lead(q1, 1)} leads, at {pct(q2)} {lead(q2, 2)} "
                 f"lead; GFWSVD's best is {ORDINALS[rank[q1].index('gfwsvd')]} at {pct(q1)} and "
                 f"{ORDINALS[rank[q2].index('gfwsvd')]} at {pct(q2)} ({num(g[q2]['ppl_ptb'])}). With the same "
                 f"`fisher` allocation at {pct(q1)}, MFF's Kronecker factors from {v['k']} gradients weight the SVD "
                 f"worse ({num(f[q1]['ppl_ptb'])}) than the diagonal Fisher (FWSVD, "
                 f"{num(t['fwsvd', 'fisher', q1]['ppl_ptb'])}) or K-FAC's per-token factors (KFAC-SVD, "
                 f"{num(t['kfac_svd', 'fisher', q1]['ppl_ptb'])}). Calibration at larger k is measured next.")
    return "\n".join(lines)


def _spectrum_shares(out: Outputs) -> str:
    share = {r["type"]: r["median_share_1"] for r in out.table("tab_singular_values") if r["model"] == "smollm2"}
    mlp = [v for k, v in share.items() if k.startswith("mlp.")]
    att = [share["self_attn.q_proj"], share["self_attn.v_proj"]]
    return (f"{span(mlp, lambda x: num(100 * x))} % of the MLP layers' Fisher against "
            f"{span(att, lambda x: num(100 * x))} % of q_proj / v_proj")


def rank_allocation_headline(out: Outputs) -> str:
    """The rank-allocation result as the command-line section quotes it."""
    t, v, p = _ra(out), out.extra(_RA)["verdict"], out.params(_RA)
    q1, q2 = p["other_ratios"][:2]
    g = lambda s, q: num(t["gfwsvd", s, q]["ppl_ptb"])  # noqa: E731
    top = v[f"ranking_{round(100 * q1)}"][0]
    best = _best(t, top, q1)
    ahead = top == "gfwsvd"
    return (f"**Per-layer ranks change this most** (rank-allocation study below; same calibration batches, PTB on the "
            f"first {num(p['eval_tokens'])} tokens, uncompressed {num(v['dense_ppl_ptb'], 1)}): at {pct(q2)} GFWSVD "
            f"goes from {g('uniform', q2)} (uniform) to {g('fisher', q2)} (`--allocation fisher`, no model evaluation) "
            f"and {g('sensitivity', q2)} (`--allocation sensitivity`, the paper's protocol, "
            f"{t['gfwsvd', 'sensitivity', q2]['allocation_evaluations']:.0f} evaluations); at {pct(q1)} from "
            f"{g('uniform', q1)} to {g('fisher', q1)} and {g('sensitivity', q1)}. The best of all methods at "
            f"{pct(q1)} is {method_name(top)} with its {best['strategy']} allocation ({num(best['ppl_ptb'])}); "
            "GFWSVD is "
            f"{'ahead' if ahead else 'not ahead'} at this scale.")


BLOCKS = {"throughput": throughput, "rank-allocation-headline": rank_allocation_headline,
          "rank-allocation-setup": rank_allocation_setup, "rank-allocation": rank_allocation,
          "rank-allocation-verdicts": rank_allocation_verdicts}
