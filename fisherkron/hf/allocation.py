r"""Per-layer ranks for a whole-model compression ratio: uniform, measured, Fisher-predicted or both.

:func:`allocate` returns the ranks :func:`fisherkron.compress` uses with ``allocation=``:

* ``"uniform"``: one per-layer compression ratio for every layer (bisected so the whole model
  reaches the target), the behaviour of ``ratio=`` alone;
* ``"sensitivity"``: the procedure of ASVD that the paper adopted (Sec. 6.3). Each layer's
  held-out loss increase at each candidate per-layer ratio is measured by
  :mod:`fisherkron.hf.sensitivity`'s sweep (``layers x candidates`` model evaluations, cached
  on disk and resumed after an interruption); then ASVD's threshold search picks the
  per-layer ratios (:func:`fisherkron.core.allocation.choose_by_threshold`);
* ``"fisher"`` (beyond the paper): no model evaluation. Each layer's curve of the error
  ``tr(dW^T B dW A)`` against its rank comes from its weighted SVD
  (:func:`fisherkron.core.allocation.truncation_errors`), in the metric of the layer's Kronecker
  Fisher: MFF's ``A (x) B`` when the calibration holds gradients, else the K-FAC factors. For
  GFWSVD (and KFAC-SVD in the K-FAC metric) the curve is Theorem 1's tail ``sum_{i>r} s~_i^2``;
  for the other methods it is the same Fisher's measure of their own truncation. All layers
  are on one scale: their Fishers are means over the same calibration batches of the gradient
  of the same loss, so ``0.5 tr(dW^T B dW A)`` is each layer's second-order loss increase in
  the same units. Ranks minimise the summed curves under the budget
  (:func:`fisherkron.core.allocation.choose_ranks`, a Lagrangian relaxation whose certified gap
  to the optimum is in ``details``; ``solver="ilp"``: the exact integer program);
* ``"calibrated"`` (beyond the paper): the fisher allocation's curves, each scaled by one number
  so that it passes through one measured point: the KL divergence from the dense model's outputs
  (``calibrate_metric="kl"``, the default: :data:`RECOMMENDED`'s) or the held-out loss increase
  (``"loss"``) with that layer alone compressed at the per-layer ratio ``calibrate_ratio``
  (default :data:`CALIBRATE_RATIO`), measured by the sensitivity sweep's machinery (one
  evaluation per layer, :class:`PrefixReplay`, the same on-disk cache and key)
  (:func:`fisherkron.core.allocation.scale_to_points`); optionally times LEMS's depth bias
  (``depth_gamma``, off by default); ranks by the exact integer program over every rank
  (:func:`fisherkron.core.allocation.knapsack`, HiGHS);
* ``"lems"``: LEMS's allocation (Thoma et al., ICML 2026) as a baseline: see :func:`lems_costs`.

:data:`RECOMMENDED` is the one recipe the package recommends (a method, its allocation and the
calibration it was measured with), chosen by a stated rule from the committed studies; the
defaults of :func:`fisherkron.compress` (called without a method) and of ``fisherkron compress``
read it.

Every strategy factorises with the options :func:`fisherkron.compress` applies
(``regularization``, ``alpha``, ``min_alpha``, ``asvd_alpha``, ``mff_options``), so what is
measured or predicted is the factorisation that follows, and a shared :class:`Decompositions`
serves both. The parameter budget (:func:`~fisherkron.hf.budget.count_params`,
:func:`~fisherkron.hf.budget.plan_ranks`) is :mod:`fisherkron.hf.budget`'s. Imports run one
way: allocation -> sensitivity, allocation -> budget; the sweep's names are importable from
here as before.
"""
from __future__ import annotations

import difflib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.allocation import (ILP_TIME_LIMIT, SOLVERS, choose_by_threshold, choose_ranks, curve_costs, depth_bias,
                               energy_shape, knapsack, max_profitable_rank, saving, scale_to_points)
from ..core.conventions import FisherkronError
from ..core.methods import method as method_row
from ..core.regularization import MIN_ALPHA
from .budget import check_ratio, count_params, plan_ranks
from .calibration import CalibrationStats
from .decompositions import Decompositions
from .sensitivity import (CODE_VERSION, METRICS, SENSITIVITY_RATIOS, OutputKL, PrefixReplay, block_index,
                          kronecker_factors, layer_statistics, loss_with_factors, mean_loss, sensitivity_sweep,
                          sweep_key)

__all__ = ["STRATEGIES", "OPTIONS", "Allocation", "allocate", "check_options", "layer_statistics", "Decompositions",
           "fisher_curves", "lems_costs", "sensitivity_sweep", "sweep_key", "mean_loss", "loss_with_factors",
           "PrefixReplay", "OutputKL", "SENSITIVITY_RATIOS", "CODE_VERSION", "CALIBRATE_RATIO", "LEMS", "MEASURED",
           "Recipe", "RECOMMENDED", "GFWSVD_RECIPE"]

log = logging.getLogger(__name__)

STRATEGIES = ("uniform", "sensitivity", "fisher", "calibrated", "lems")
#: the strategies that measure the model on held-out batches (``heldout``)
MEASURED = ("sensitivity", "calibrated", "lems")


@dataclass(frozen=True)
class Recipe:
    """A method, how its per-layer ranks are allocated for a ratio, and the calibration it was measured with.

    Attributes:
        method: a key of :data:`fisherkron.METHODS`.
        allocation: a strategy of :func:`allocate` (it applies to a target ``ratio=``; with
            ``rank=`` every layer takes that rank).
        calibrate_metric: what ``"calibrated"`` measures at its one point per layer (``None`` for
            the other allocations).
        k, batch_size, seq_len: the calibration: ``k`` batches of ``batch_size`` sequences of
            ``seq_len`` tokens (:func:`fisherkron.lm_batches`).
        heldout_batches: held-out batches of the same shape for the measured allocations, drawn
            from documents the calibration does not see.

    >>> RECOMMENDED.describe()
    'kfac_svd with the calibrated allocation (one KL point per layer)'
    >>> RECOMMENDED.study_label()
    'calibrated_kl'
    """

    method: str
    allocation: str
    calibrate_metric: str | None
    k: int
    batch_size: int
    seq_len: int
    heldout_batches: int

    def describe(self) -> str:
        """The recipe in words (:func:`describe`)."""
        return describe(self.method, self.allocation, self.calibrate_metric)

    def study_label(self) -> str:
        """The allocation's name in the allocation study's table (``calibrated_kl`` for the KL-calibrated one)."""
        return self.allocation + ("_kl" if self.allocation == "calibrated" and self.calibrate_metric == "kl" else "")

    def matches(self, method: str, allocation: str, calibrate_metric: str | None) -> bool:
        """Whether a compression with these settings ran this recipe's method and allocation."""
        return (method, allocation, calibrate_metric if allocation == "calibrated" else None) == (
            self.method, self.allocation, self.calibrate_metric)


def describe(method: str, allocation: str, calibrate_metric: str | None = None) -> str:
    """What a compression runs, in words, for progress lines and reports.

    >>> describe("gfwsvd", "sensitivity")
    "gfwsvd with the sensitivity allocation (ASVD's sweep, several ratios per layer)"
    """
    what = {"uniform": "one ratio for every layer", "fisher": "Theorem 1's curves, no model evaluation",
            "sensitivity": "ASVD's sweep, several ratios per layer",
            "calibrated": f"one {'KL' if calibrate_metric == 'kl' else 'loss'} point per layer",
            "lems": "one KL point per layer"}.get(allocation, allocation)
    return f"{method} with the {allocation} allocation ({what})"


#: The recommended recipe, the default of ``fisherkron compress MODEL --ratio R`` and of
#: ``fisherkron.compress(model, stats, ratio=R)``: KFAC-SVD with the KL-calibrated allocation,
#: calibrated on 32 batches of 2 x 256 tokens.
#:
#: The rule, and where its evidence is. *Method and allocation*: the (method, allocation) pair with the
#: lowest PTB perplexity at every target ratio of the allocation study (``notebooks/fig_allocation_cost.py``;
#: every case in ``figures/tab_allocation_cost.csv``, the "Best at ..." lines of
#: ``figures/fig_allocation_cost_summary.provenance.json``), which compared uniform, fisher, sensitivity,
#: LEMS and both calibrated variants for GFWSVD, KFAC-SVD and SVD-LLM: the row ``kfac_svd`` /
#: ``calibrated_kl`` is best at each ratio. *Metric*: the KL divergence, which the same record's
#: ``extra.verdict.head_to_head`` finds better than the held-out loss (more (method, ratio) pairs won, and a
#: geometric mean of the perplexity ratio below 1). *Calibration*: the setting that row was measured at
#: (the record's ``k``, ``batch_size``, ``seq_len`` and ``heldout_k``), kept because the recipe's quality
#: is known there and only there: the calibration study (``notebooks/fig_calibration.py``, the
#: ``kfac_svd`` rows of ``figures/tab_calibration.csv``) measured KFAC-SVD far worse at its smallest k and
#: about level at the k just below, and K-FAC's statistics cost little per batch
#: (``figures/fig_calibration_summary.provenance.json``, ``extra.verdict.warm_start``), so a smaller k
#: would save little. ``tests/test_recipe.py`` checks each of these against the committed records: a
#: study re-run that moves the best row fails it, and this constant is then revised with that evidence.
RECOMMENDED = Recipe(method="kfac_svd", allocation="calibrated", calibrate_metric="kl", k=32, batch_size=2,
                     seq_len=256, heldout_batches=2)
#: GFWSVD (the paper's method, ``--method gfwsvd``) with its own best allocation in the same study: the
#: KL-calibrated one again (lowest PTB of the ``gfwsvd`` rows at every ratio but one, where the
#: loss-calibrated allocation's PTB is lower by less than 1 % and its Wikipedia perplexity and held-out loss are
#: higher); the paper's protocol allocates by ASVD's sensitivity sweep instead (``allocation="sensitivity"``, Sec. 6.3).
GFWSVD_RECIPE = Recipe(method="gfwsvd", allocation="calibrated", calibrate_metric="kl", k=RECOMMENDED.k,
                       batch_size=RECOMMENDED.batch_size, seq_len=RECOMMENDED.seq_len,
                       heldout_batches=RECOMMENDED.heldout_batches)
#: the keys of ``compress(allocation_options=)``: the arguments of :func:`allocate` that compress leaves to the user
OPTIONS = ("heldout", "loss_fn", "loss_name", "sensitivity_ratios", "cache", "cache_dir", "calibrate_metric",
           "calibrate_ratio", "kl_temperature", "depth_gamma", "rank_multiple", "solver", "time_limit")
#: the per-layer ratio (fraction of the layer's weights removed) at which ``"calibrated"`` measures its one point
#: per layer: the middle of the range the allocations choose from, where Theorem 1's second-order prediction and
#: the measured increase are both well above the held-out noise and the curve is not yet extrapolated far
CALIBRATE_RATIO = 0.5
#: LEMS's defaults (their ``configs/search/lems.yaml``): one KL point at 10 % of the layer's rank (per-layer
#: ratio 0.9), softmax temperature 0.6, ``harmonicv2`` depth bias with gamma 5 (alpha 0), ranks multiples of 8
#: between 30 % (10 % when more than half of the layers' weights go) and 95 % of the layer's equal-size rank
LEMS = {"calibrate_ratio": 0.9, "kl_temperature": 0.6, "depth_gamma": 5.0, "depth_alpha": 0.0, "rank_multiple": 8,
        "lowest": (0.3, 0.1), "highest": 0.95}
#: which of the options beyond the sweep's each strategy reads, and their defaults there (``None``: not read)
_DEFAULTS = {
    "uniform": {},
    "sensitivity": {},
    "fisher": {"solver": "lagrangian", "time_limit": ILP_TIME_LIMIT},
    "calibrated": {"calibrate_metric": RECOMMENDED.calibrate_metric, "calibrate_ratio": CALIBRATE_RATIO,
                   "kl_temperature": 1.0,
                   "depth_gamma": 0.0, "rank_multiple": 1, "solver": "ilp", "time_limit": ILP_TIME_LIMIT},
    "lems": {"calibrate_metric": "kl", "calibrate_ratio": LEMS["calibrate_ratio"],
             "kl_temperature": LEMS["kl_temperature"], "depth_gamma": LEMS["depth_gamma"],
             "rank_multiple": LEMS["rank_multiple"], "solver": "ilp", "time_limit": ILP_TIME_LIMIT},
}
#: the arguments of :func:`allocate` that compress sets from its own (``{allocate's name: compress's name}``)
FROM_COMPRESS = {"ratio": "ratio", "strategy": "allocation", "min_alpha": "min_alpha", "mff_options": "mff_options",
                 "regularization": "regularization", "alpha": "alpha", "asvd_alpha": "asvd_alpha",
                 "decompositions": "decompositions", "progress": "progress"}


def check_options(options) -> dict:
    """``compress``'s ``allocation_options`` as keyword arguments of :func:`allocate`, or a one-line error.

    >>> check_options({"heldout": []})
    {'heldout': []}
    >>> check_options({"heldotu": []})
    Traceback (most recent call last):
    fisherkron.core.errors.FisherkronError: allocation_options has no key 'heldotu'; did you mean 'heldout'? ...
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise FisherkronError(f"allocation_options must be a dict with keys among {', '.join(OPTIONS)}; "
                              f"got a {type(options).__name__}")
    for key in options:
        if key in OPTIONS:
            continue
        if key in FROM_COMPRESS:
            raise FisherkronError(f"allocation_options sets {key!r}, which compress passes on from its own "
                                  f"arguments; give compress {FROM_COMPRESS[key]}= instead")
        near = difflib.get_close_matches(str(key), OPTIONS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise FisherkronError(f"allocation_options has no key {key!r}{hint} (the keys: {', '.join(OPTIONS)})")
    return dict(options)


@dataclass
class Allocation:
    """Ranks per layer (``None``: kept dense) for a target whole-model ratio, and what they cost."""

    strategy: str
    method: str
    target_ratio: float
    ranks: dict[str, int | None]
    removed: int
    total_params: int
    evaluations: int = 0
    seconds: float = 0.0
    predicted: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Whole-model compression ratio these ranks reach."""
        return self.removed / self.total_params

    @property
    def dense(self) -> list[str]:
        return [n for n, r in self.ranks.items() if r is None]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def _decomposition(cache: Decompositions | None, module, method, stats, name, **kwargs):
    return (cache if cache is not None else Decompositions()).get(module, method, stats, name, **kwargs)


def _metric(stats: CalibrationStats, name: str, mff_options: dict | None, device=None):
    """The Kronecker Fisher ``(A, B)`` of a layer: MFF's when gradients were collected, else K-FAC's."""
    if "grads" in stats.stats:
        res = kronecker_factors(stats, name, mff_options, device)
        return res["A"], res["B"], "mff"
    if "kfac" in stats.stats:
        kf = stats.kfac(name)
        return kf.A, kf.B, "kfac"
    raise FisherkronError("the fisher allocation needs per-batch gradients ('grads', for MFF) or the K-FAC "
                          "factors ('kfac') in the calibration statistics; collect them")


def fisher_curves(model: nn.Module, method: str, stats: CalibrationStats, names: list[str], *,
                  min_alpha: float = MIN_ALPHA, mff_options: dict | None = None, device=None,
                  regularization: str = "diag", alpha: float | None = None, asvd_alpha: float = 0.5,
                  decompositions: Decompositions | None = None,
                  progress: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """Predicted loss increase ``0.5 tr(dW^T B dW A)`` of every layer at every rank, and the metric used.

    Each layer is factorised as :func:`fisherkron.compress` would with the same options
    (``regularization``, ``alpha``, ``min_alpha``, ``asvd_alpha``, ``mff_options``);
    ``decompositions`` (a :class:`Decompositions`) keeps each layer's weighted SVD for the
    compression that follows.
    """
    mods = dict(model.named_modules())
    curves, metric = {}, None
    for name in tqdm(names, desc=f"fisher curves ({method})", disable=not progress):
        dec, given = _decomposition(decompositions, mods[name], method, stats, name, mff_options=mff_options,
                                    min_alpha=min_alpha, regularization=regularization, alpha=alpha,
                                    asvd_alpha=asvd_alpha, device=device)
        if "A" in given:  # a computed GFWSVD entry read MFF's factors: they are the metric
            A, B, metric = given["A"], given["B"], "mff"
        else:
            A, B, metric = _metric(stats, name, mff_options, device)
        curves[name] = 0.5 * dec.errors(A, B)
    return curves, metric


def _strategy_options(strategy: str, given: dict) -> dict:
    """The options beyond the sweep's that ``strategy`` reads, with its defaults; one-line errors for the others."""
    defaults = _DEFAULTS[strategy]
    for key, value in given.items():
        if value is not None and key not in defaults:
            readers = [st for st, d in _DEFAULTS.items() if key in d]
            raise FisherkronError(f"allocation {strategy!r} does not read {key}; it applies to "
                                  f"{' and '.join(repr(r) for r in readers)}")
    opt = {key: given[key] if given.get(key) is not None else value for key, value in defaults.items()}
    if "solver" in opt:
        if opt["solver"] not in SOLVERS:
            raise FisherkronError(f"solver {opt['solver']!r} is unknown; use one of {', '.join(SOLVERS)}")
        if opt["solver"] != "ilp" and given.get("time_limit") is not None:
            raise FisherkronError("time_limit bounds HiGHS's search, which only solver='ilp' runs; drop it")
        t = opt["time_limit"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise FisherkronError(f"time_limit must be a number of seconds > 0; got {t!r}")
    if "calibrate_metric" not in opt:
        return opt
    if opt["calibrate_metric"] not in METRICS:
        raise FisherkronError(f"calibrate_metric {opt['calibrate_metric']!r} is unknown; use one of "
                              f"{', '.join(METRICS)}")
    if strategy == "lems" and opt["calibrate_metric"] != "kl":
        raise FisherkronError("LEMS measures the KL divergence from the dense outputs; drop calibrate_metric, or "
                              "use allocation='calibrated' for the loss")
    if opt["calibrate_metric"] != "kl" and given.get("kl_temperature") is not None:
        raise FisherkronError("kl_temperature applies to calibrate_metric='kl'; drop it or measure the KL")
    rho = opt["calibrate_ratio"]
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0.0 < rho < 1.0:
        raise FisherkronError(f"calibrate_ratio must be a per-layer ratio in (0, 1), the fraction of a layer's "
                              f"weights removed at the measured point; got {rho!r}")
    for key in ("kl_temperature", "depth_gamma"):
        v = opt[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                key == "kl_temperature" and v == 0):
            raise FisherkronError(f"{key} must be a number {'> 0' if key == 'kl_temperature' else '>= 0'}; got {v!r}")
    k = opt["rank_multiple"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise FisherkronError(f"rank_multiple must be an integer >= 1 (the candidate ranks are its multiples); "
                              f"got {k!r}")
    return opt


def _depth(model: nn.Module, names: list[str], gamma: float, alpha: float = 0.0) -> dict[str, float]:
    """Each layer's depth multiplier (:func:`~fisherkron.core.allocation.depth_bias`); all 1 when ``gamma`` is 0."""
    if gamma == 0:
        return {n: 1.0 for n in names}
    found = block_index(model, names)
    if found is None:
        raise FisherkronError("the depth bias needs the layers inside one list of blocks (an nn.ModuleList); "
                              "pass depth_gamma=0")
    index, blocks = found
    return {n: depth_bias(index[n], blocks, gamma, alpha) for n in names}


def _points(sweep: dict, names: list[str]) -> dict[str, tuple[int, float]]:
    """The one measured ``(rank, value)`` of each layer in a one-ratio sweep (layers with no saving rank have none)."""
    return {n: next(iter(sweep["table"][n].items())) for n in names if sweep["table"].get(n)}


def lems_costs(decompositions: Mapping, shapes: Mapping[str, tuple[int, int]], points: Mapping[str, tuple[int, float]],
               bias: Mapping[str, float], removed_share: float, rank_multiple: int = LEMS["rank_multiple"]
               ) -> dict[str, dict[int | None, float]]:
    r"""LEMS's predicted cost of every candidate rank of every layer (Thoma et al., ICML 2026, "LEMS").

    Per layer, with ``s`` the singular values of the method's decomposition (``dec.S``: the
    whitened / weighted matrix's), ``r_0`` the measured rank and ``KL_0`` the KL divergence of the
    outputs from the dense outputs with that layer alone at rank ``r_0`` (``points``), and
    ``beta`` its depth bias (``bias``):

    .. math:: \text{cost}(r) = \beta\, \mathrm{KL}_0\,
              \frac{\sum_{i>r} s_i^2 / \sum_i s_i^2}{\max(\sum_{i>r_0} s_i^2 / \sum_i s_i^2,\ 10^{-6})}

    (:func:`~fisherkron.core.allocation.energy_shape`), at the ranks ``r`` that are multiples of
    ``rank_multiple`` with ``lowest r_eq <= r < floor(0.95 r_eq)``, ``r_eq = floor(n m / (n + m))``
    the rank of a factorisation as large as the layer, ``lowest`` 0.3, or 0.1 when
    ``removed_share`` (the fraction of the selected layers' weights to remove) exceeds one half;
    and "dense" at cost 0. ``allocate(strategy="lems")`` measures ``KL_0`` at the per-layer
    ratio 0.9 (``r_0 = floor(0.1 r_eq)``, 10 % of the rank), temperature 0.6, with the
    ``harmonicv2`` bias at ``gamma = 5``, ``alpha = 0`` (:func:`~fisherkron.core.allocation.depth_bias`),
    and chooses the ranks by the integer program (:func:`~fisherkron.core.allocation.knapsack`).

    Where this differs from LEMS's code (``compression/search/lems.py``,
    ``_sensitivity_base.py``, ``configs/search/lems.yaml``), and why:

    * the depth bias keeps the configuration's ``alpha = 0``, ``gamma = 5``. Their ``search()``
      with ``crosslayer_term="harmonicv2"`` replaces both by 10 Optuna trials over
      ``alpha in [0, 3]``, ``gamma in [0, 7]``, each compressing the whole model and measuring
      its KL: ten more whole-model evaluations and a search over two hyper-parameters, not the
      one-measurement-per-layer method compared here (``depth_gamma`` is open to a caller who
      wants to tune it). A layer's block is its index in the model's list of blocks (theirs:
      its position among the searched layers over the linear layers per block: the same for a
      whole-model selection);
    * HiGHS (SciPy's ``milp``, open source) instead of Gurobi (commercial), to a relative gap of
      ``1e-5`` (Gurobi's default is ``1e-4``), with the Lagrangian as a fallback; the monotonicity
      constraints their ILP offers are off in LEMS's settings and absent here;
    * the budget is the paper's whole-model ratio (parameters removed ``>= ratio`` of the model,
      each rank costing exactly ``r (n + m)``) instead of "kept parameters of the searched linear
      layers ``<=`` target times their total" with a rank costing ``(r / r_eq) n m``;
    * the KL is the mean over every token the attention mask keeps, summed in float64 against
      float32 dense logits. Theirs skips the first 256 positions of 2,048-token sequences (ours
      are 256 tokens long: nothing would be left) and keeps the dense logits in bfloat16;
    * the measured rank is at least 1 (theirs is ``int(0.1 r_eq)``, 0 for ``r_eq < 10``: an
      all-zero layer), and ``r % 8 == 0`` is tested on the rank itself (theirs on
      ``int((r / r_eq) r_eq)``, which float round-off can make ``r - 1``);
    * the measurements use the held-out batches given (``heldout``), cached under the sweep's
      key; theirs use 32 sequences of 2,048 tokens (``search_samples``) and a pickle named after
      the method, loss and model only.
    """
    costs = {}
    for name, (r0, kl) in points.items():
        n, m = shapes[name]
        eq = n * m // (n + m)
        lowest = LEMS["lowest"][1] if removed_share > 0.5 else LEMS["lowest"][0]
        shape = energy_shape(decompositions[name].S, r0).numpy()  # (q + 1,)
        ranks = [r for r in range(max(1, int(0.1 * eq)), int(LEMS["highest"] * eq))
                 if r >= lowest * eq and r % rank_multiple == 0 and saving(n, m, r) > 0]
        costs[name] = {**{r: float(bias[name] * kl * shape[r]) for r in ranks}, None: 0.0}
    for name in shapes:
        costs.setdefault(name, {None: 0.0})
    return costs


def allocate(model: nn.Module, method: str, stats: CalibrationStats | None, names: list[str], *, ratio: float,
             strategy: str = "fisher", heldout=None, loss_fn=None, loss_name: str | None = None,
             sensitivity_ratios=SENSITIVITY_RATIOS, min_alpha: float = MIN_ALPHA, mff_options: dict | None = None,
             regularization: str = "diag", alpha: float | None = None, asvd_alpha: float = 0.5,
             cache: bool = True, cache_dir=None, decompositions: Decompositions | None = None,
             calibrate_metric: str | None = None, calibrate_ratio: float | None = None,
             kl_temperature: float | None = None, depth_gamma: float | None = None, rank_multiple: int | None = None,
             solver: str | None = None, time_limit: float | None = None,
             progress: bool = False) -> Allocation:
    """Ranks of the layers ``names`` that compress the whole model by at least ``ratio``.

    Args:
        model: the model to be compressed (unchanged here).
        method: a key of :data:`fisherkron.METHODS`.
        stats: its calibration statistics (``fisher`` and ``calibrated`` need gradients or K-FAC
            factors).
        names: the layers to compress.
        ratio: target whole-model ratio ``1 - params_after / params_before``, in (0, 1).
        strategy: ``"uniform"``, ``"sensitivity"`` (needs ``heldout``), ``"fisher"``,
            ``"calibrated"`` (needs ``heldout``) or ``"lems"`` (needs ``heldout``).
        heldout: calibration batches not used for the statistics (the measuring strategies); never
            the evaluation text.
        loss_fn: ``loss_fn(model, batch)`` of the sweep (default ``model(**batch).loss``).
        loss_name: a name unique to ``loss_fn``, for the sweep's cache key in place of its
            description (needed for a loss that captures an object with state).
        sensitivity_ratios: the candidate per-layer ratios of the sweep.
        min_alpha, mff_options, regularization, alpha, asvd_alpha: as for
            :func:`fisherkron.compress`, which passes its own: the factorisation measured is
            the one that follows.
        cache, cache_dir: keep the measurements on disk (default ``data/cache/allocation``).
        decompositions: a :class:`Decompositions` shared with the compression that follows.
        calibrate_metric: ``calibrated``: ``"kl"`` (KL divergence from the dense outputs, the default:
            :data:`RECOMMENDED`'s) or ``"loss"`` (held-out loss increase); ``lems`` measures ``"kl"``.
        calibrate_ratio: the per-layer ratio (fraction of the layer's weights removed) of the one
            measured point per layer: :data:`CALIBRATE_RATIO` for ``calibrated``, 0.9 (10 % of
            the layer's rank) for ``lems``.
        kl_temperature: softmax temperature of the KL (1 for ``calibrated``, LEMS's 0.6).
        depth_gamma: LEMS's ``harmonicv2`` depth bias (0: off, ``calibrated``'s default; LEMS's 5).
        rank_multiple: candidate ranks are its multiples (1 for ``calibrated``: every rank; LEMS's 8).
        solver: ``"ilp"`` (exact, HiGHS; ``calibrated`` and ``lems``) or ``"lagrangian"``
            (``fisher``'s default, with its certified gap in ``details``).
        time_limit: seconds HiGHS may take before the Lagrangian's ranks are used with a warning
            (:data:`~fisherkron.core.allocation.ILP_TIME_LIMIT`).
        progress: tqdm bars.

    Every option left ``None`` takes the strategy's default; one the strategy does not read is
    refused in one line.
    """
    if strategy not in STRATEGIES:
        raise FisherkronError(f"allocation {strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    method_row(method)
    if strategy in MEASURED:
        heldout = list(heldout or ())
    if strategy in MEASURED and not heldout:
        raise FisherkronError(f"the {strategy} allocation measures each layer on held-out batches: pass heldout= "
                              f"(with compress: allocation_options={{'heldout': batches}}), batches drawn from "
                              f"documents the calibration did not see, e.g. fisherkron.lm_batches(tokenizer, "
                              f"held_out_documents, {RECOMMENDED.heldout_batches})")
    ratio = check_ratio(ratio)
    opt = _strategy_options(strategy, dict(calibrate_metric=calibrate_metric, calibrate_ratio=calibrate_ratio,
                                           kl_temperature=kl_temperature, depth_gamma=depth_gamma,
                                           rank_multiple=rank_multiple, solver=solver, time_limit=time_limit))
    mods = dict(model.named_modules())
    shapes = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    if strategy in ("calibrated", "lems") and decompositions is None:
        decompositions = Decompositions()  # one SVD per layer serves the curves and the measurements
    options = dict(min_alpha=min_alpha, mff_options=mff_options, regularization=regularization, alpha=alpha,
                   asvd_alpha=asvd_alpha, decompositions=decompositions, progress=progress)
    total = count_params(model)
    need = math.ceil(ratio * total)
    t0 = time.perf_counter()
    if strategy == "uniform":
        ranks = plan_ranks(model, names, ratio=ratio)
        ranks = {n: (r if saving(*shapes[n], r) > 0 else None) for n, r in ranks.items()}
        out = Allocation(strategy, method, ratio, ranks, 0, total)
    elif strategy == "fisher":
        if stats is None:
            raise FisherkronError("the fisher allocation needs calibration statistics (stats=)")
        curves, metric = fisher_curves(model, method, stats, names, **options)
        if opt["solver"] == "lagrangian":
            info: dict = {}
            ranks = choose_ranks(curves, shapes, need, info=info)
            solved = {"solver": "lagrangian", "optimal": False, "cost": info["cost"], "bound": info["bound"],
                      "gap": info["gap"], "lambda": info["lambda"]}
        else:
            choice = knapsack(curve_costs(curves, shapes), shapes, need, time_limit=opt["time_limit"])
            ranks, solved = choice.ranks, _solved(choice)
        predicted = {n: float(curves[n][r]) if r is not None else 0.0 for n, r in ranks.items()}
        out = Allocation(strategy, method, ratio, ranks, 0, total, predicted=predicted,
                         details={"metric": metric, "curves_max_rank": {n: max_profitable_rank(*shapes[n])
                                                                         for n in names}, **solved})
    elif strategy in ("calibrated", "lems"):
        if strategy == "calibrated" and stats is None:
            raise FisherkronError("the calibrated allocation scales the fisher allocation's curves, which need "
                                  "calibration statistics (stats=)")
        what = f"one {'KL' if opt['calibrate_metric'] == 'kl' else 'loss'} point per layer"
        sweep = sensitivity_sweep(model, method, stats, names, heldout, ratios=(opt["calibrate_ratio"],),
                                  loss_fn=loss_fn, loss_name=loss_name, cache=cache, cache_dir=cache_dir,
                                  metric=opt["calibrate_metric"],
                                  temperature=opt["kl_temperature"] if opt["calibrate_metric"] == "kl" else 1.0,
                                  label=(f"calibrating ({method}, {what})" if strategy == "calibrated"
                                         else f"LEMS ({method}, {what})"), **options)
        points = _points(sweep, names)
        bias = _depth(model, names, opt["depth_gamma"], LEMS["depth_alpha"])
        details = {"calibrate_metric": opt["calibrate_metric"], "calibrate_ratio": opt["calibrate_ratio"],
                   "depth_gamma": opt["depth_gamma"], "points": {n: list(p) for n, p in points.items()},
                   "base_loss": sweep["base"], "from_cache": sweep["from_cache"], "sweep_seconds": sweep["seconds"],
                   "cache": sweep["path"]}
        if opt["calibrate_metric"] == "kl":
            details["kl_temperature"] = opt["kl_temperature"]
        if strategy == "calibrated":
            curves, metric = fisher_curves(model, method, stats, names, **options)
            scaled, scales, fell = scale_to_points({n: curves[n] for n in points}, points)
            if fell:
                log.warning("calibrated allocation: %d layer(s) measured no increase at their point (e.g. %s); "
                            "they take the smallest positive scale of the others", len(fell), fell[0])
            curves = {n: bias[n] * scaled[n] if n in scaled else curves[n].numpy() for n in names}
            step = opt["rank_multiple"]
            costs = curve_costs(curves, shapes, None if step == 1 else
                                {n: range(step, max_profitable_rank(*shapes[n]) + 1, step) for n in names})
            details.update(metric=metric, scales=scales, fallback_scale=fell)
        else:
            decs = {n: _decomposition(decompositions, mods[n], method, stats, n, mff_options=mff_options,
                                      min_alpha=min_alpha, regularization=regularization, alpha=alpha,
                                      asvd_alpha=asvd_alpha)[0] for n in points}
            removed_share = need / sum(n * m for n, m in shapes.values())
            costs = lems_costs(decs, shapes, points, bias, removed_share, opt["rank_multiple"])
            details.update(rank_multiple=opt["rank_multiple"], depth_bias=bias)
        choice = knapsack(costs, shapes, need, solver=opt["solver"], time_limit=opt["time_limit"])
        predicted = {n: float(costs[n][r]) for n, r in choice.ranks.items()}
        out = Allocation(strategy, method, ratio, choice.ranks, 0, total, evaluations=sweep["evaluations"],
                         predicted=predicted, details={**details, **_solved(choice)})
    else:
        sweep = sensitivity_sweep(model, method, stats, names, heldout, ratios=sensitivity_ratios, loss_fn=loss_fn,
                                  loss_name=loss_name, cache=cache, cache_dir=cache_dir,
                                  label=f"sensitivity ({method}, {len(sensitivity_ratios)} ratios per layer)",
                                  **options)
        ranks, tau = choose_by_threshold(sweep["table"], shapes, need)
        out = Allocation(strategy, method, ratio, ranks, 0, total, evaluations=sweep["evaluations"],
                         details={"threshold": tau, "base_loss": sweep["base"], "from_cache": sweep["from_cache"],
                                  "sweep_seconds": sweep["seconds"], "cache": sweep["path"]})
    out.removed = sum(saving(*shapes[n], r) for n, r in out.ranks.items())
    out.seconds = time.perf_counter() - t0
    if out.removed < need:  # pragma: no cover - every strategy meets the budget by construction
        raise FisherkronError(f"allocation {strategy} removes {out.removed:,} < {need:,} parameters")
    return out


def _solved(choice) -> dict:
    """What :func:`~fisherkron.core.allocation.knapsack` proved, for ``Allocation.details``."""
    return {"solver": choice.solver, "optimal": choice.optimal, "cost": choice.cost, "bound": choice.bound,
            "gap": choice.gap, "mip_gap": choice.mip_gap, "solve_seconds": choice.seconds}
