"""Tolerances of tables whose ``save_table`` call does not declare them (``make verify``).

A notebook declares its tables' tolerances in its ``save_table(..., tolerances=...)`` call
(grammar: :mod:`fisherkron.repro.tolerance`); that declaration is recorded in the table's
provenance record and wins. This file holds the declarations of tables whose producer has none
yet, so that ``make verify`` does not fall back to its defaults for them. Each table is declared
in one place: when a notebook starts declaring a table's tolerances, delete its entry here
(``make verify`` says "also in verify_tolerances.py" while both exist).

Reasons, once:

* counts, ranks, sizes, labels, configuration: ``exact``;
* float32 linear algebra on model gradients (Lanczos spectra, weighted SVDs): the summation
  order differs between Intel and AMD kernels and thread counts, so relative tolerances of
  1e-3 for spectra and 2 % for perplexities (a compressed model amplifies a change of one
  singular vector; 2 % is still far below any difference the tables are read for);
* seed means written ``mean ± sd``: 3 standard errors (sd / sqrt(seeds)), plus half a unit of
  the printed last digit (the cells are rounded to 3 decimals);
* times, rates and memory, and values decided by one (a time limit): ``timing``.
"""
from __future__ import annotations

PPL = "rel=0.02"  # a compressed model's perplexity, float32 on another CPU
SPECTRUM = "rel=1e-3"  # ratios and shares of the Kronecker spectrum (float32 Lanczos)
GLUE_SEEDS = "3*pm/sqrt(3) + abs=0.0005"  # mean ± sd over the 3 fine-tuning seeds, printed to 3 decimals

#: table name -> column -> tolerance
TOLERANCES: dict[str, dict[str, str]] = {
    # notebooks/fig_singular_values.py
    "tab_singular_values": {
        "model": "exact", "type": "exact", "layers": "exact", "gap_layers": "exact",
        "median_ratio_12": SPECTRUM, "median_share_1": SPECTRUM, "min_share_1": SPECTRUM,
        "max_share_1": SPECTRUM, "median_share_top": SPECTRUM},
    "tab_singular_values_layers": {
        "model": "exact", "layer": "exact", "type": "exact", "n": "exact", "m": "exact", "k": "exact",
        "ratio_12": SPECTRUM, "share_1": SPECTRUM, "share_top": SPECTRUM,
        "matvecs": "abs=2",  # Lanczos products until the error estimate is below tol: float32-dependent
        "converged": "exact",
        "residual": "abs=1e-3",  # below the run's tol (1e-3) whenever converged
        **{f"s{i}/s1": SPECTRUM for i in range(1, 11)}},
    "tab_singular_values_k": {
        "model": "exact", "layer": "exact", "k": "exact",
        "ratio_12": SPECTRUM, "share_1": SPECTRUM, "share_top": SPECTRUM},
    # notebooks/fig_rank_allocation.py
    "tab_rank_allocation": {
        "method": "exact", "strategy": "exact", "target_ratio": "exact", "ratio": "abs=1e-3",
        "ppl_ptb": PPL, "ppl_wiki": PPL, "ptb_x_dense": PPL, "dense_layers": "exact",
        "allocation_evaluations": "exact", "sweep_seconds": "timing", "allocation_seconds": "timing",
        "compress_seconds": "timing"},
    # notebooks/fig_calibration.py
    "tab_calibration": {
        "setting": "exact", "k": "exact", "granularity": "exact", "gradients": "exact", "method": "exact",
        "target_ratio": "exact", "ratio": "abs=1e-3", "ppl_ptb": PPL, "ppl_wiki": PPL, "ptb_x_dense": PPL,
        "dense_layers": "exact", "compress_seconds": "timing"},
    "tab_calibration_cost": {
        "setting": "exact", "gradients": "exact", "tokens": "exact", "collect_s": "timing",
        "tokens_per_s": "timing", "mff_s": "timing", "matvecs": "rel=0.1", "mff_gflops_per_s": "timing",
        "compress_s": "timing", "total_min": "timing", "disk_gb": "rel=1e-3", "peak_rss_gb": "timing",
        "measured_now": "timing",  # whether the run measured the cost or read it from an earlier run
        "others_load": "timing"},  # the share of the cores other processes used: the machine, not the method
    # notebooks/tab_glue_results.py
    "tab_glue_results": {"Method / Rank": "exact",
                         **{r: GLUE_SEEDS for r in ("300", "250", "125", "50", "25", "5", "1")}},
    "tab_glue_extended": {"block": "exact", "method": "exact",
                          **{c: GLUE_SEEDS for c in ("SST-2 (accuracy)", "BoolQ (mcc)", "TREC-6 (accuracy)",
                                                     "MRPC (f1)", "RTE (accuracy)", "macro avg")}},
}
