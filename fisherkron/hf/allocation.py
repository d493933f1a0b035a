r"""Per-layer ranks for a whole-model compression ratio: uniform, measured sensitivity, or Fisher-predicted.

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
  (:func:`fisherkron.core.allocation.choose_ranks`).

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

from ..core.allocation import choose_by_threshold, choose_ranks, max_profitable_rank, saving
from ..core.conventions import FisherkronError
from ..core.methods import method as method_row
from ..core.regularization import MIN_ALPHA
from .budget import check_ratio, count_params, plan_ranks
from .calibration import CalibrationStats, layer_fingerprint
from .sensitivity import (CODE_VERSION, SENSITIVITY_RATIOS, PrefixReplay, decompose_layer, kronecker_factors,
                          layer_statistics, loss_with_factors, mean_loss, options_key, sensitivity_sweep, sweep_key)

__all__ = ["STRATEGIES", "OPTIONS", "Allocation", "allocate", "check_options", "layer_statistics", "Decompositions",
           "fisher_curves", "sensitivity_sweep", "sweep_key", "mean_loss", "loss_with_factors", "PrefixReplay",
           "SENSITIVITY_RATIOS", "CODE_VERSION"]

log = logging.getLogger(__name__)

STRATEGIES = ("uniform", "sensitivity", "fisher")
#: the keys of ``compress(allocation_options=)``: the arguments of :func:`allocate` that compress leaves to the user
OPTIONS = ("heldout", "loss_fn", "loss_name", "sensitivity_ratios", "cache", "cache_dir")
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
    fisherkron.core.conventions.FisherkronError: allocation_options has no key 'heldotu'; did you mean 'heldout'? ...
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


class Decompositions:
    """Each layer's full weighted SVD by a method, computed once and sliced for every rank asked.

    :func:`fisher_curves`, :func:`sensitivity_sweep`, :func:`allocate` and
    :func:`fisherkron.compress` take one as ``decompositions=``: a study that compresses a model
    at several ratios and allocations then runs one SVD per (method, layer) instead of one per
    case. An entry is keyed by the method, the layer's name, weight fingerprint, dtype and
    device, the calibration key and every option that changes the weights (regularisation,
    ``mff_options``, described by content), so a changed weight or statistic is recomputed,
    never served stale. In memory only (float64: about ``8 (n + m) min(n, m)`` bytes a
    layer); :meth:`clear` frees it.
    """

    def __init__(self):
        self._store: dict[tuple, tuple] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        self._store.clear()

    def get(self, module: nn.Linear, method: str, stats: CalibrationStats | None, name: str, *,
            mff_options: dict | None = None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
            regularization: str = "diag", asvd_alpha: float = 0.5, device=None, info: dict | None = None):
        """The :class:`~fisherkron.core.wsvd.Decomposition` of ``module`` by ``method``, and the statistics read.

        Returns ``(decomposition, given)`` where ``given`` are the statistics
        (:func:`layer_statistics`); ``info`` receives MFF's diagnostics for the GFWSVD family.
        """
        W = module.weight
        key = (method, name, layer_fingerprint(module), str(W.dtype), str(W.device),
               stats.key if stats is not None else None,
               options_key(alpha=alpha, min_alpha=min_alpha, regularization=regularization,
                           asvd_alpha=asvd_alpha if method == "asvd" else None, mff_options=mff_options or {}))
        hit = self._store.get(key)
        if hit is not None:
            self.hits += 1
            if info is not None:
                info.update(hit[2])
            return hit[0], hit[1]
        self.misses += 1
        mff_info: dict = {}
        dec, given = decompose_layer(module, method, stats, name, mff_options=mff_options, alpha=alpha,
                                     min_alpha=min_alpha, regularization=regularization, asvd_alpha=asvd_alpha,
                                     device=device, info=mff_info)
        self._store[key] = (dec, given, mff_info)
        if info is not None:
            info.update(mff_info)
        return dec, given


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
        if "A" in given:  # the GFWSVD family already read MFF's factors: they are the metric
            A, B, metric = given["A"], given["B"], "mff"
        else:
            A, B, metric = _metric(stats, name, mff_options, device)
        curves[name] = 0.5 * dec.errors(A, B)
    return curves, metric


def allocate(model: nn.Module, method: str, stats: CalibrationStats | None, names: list[str], *, ratio: float,
             strategy: str = "fisher", heldout=None, loss_fn=None, loss_name: str | None = None,
             sensitivity_ratios=SENSITIVITY_RATIOS, min_alpha: float = MIN_ALPHA, mff_options: dict | None = None,
             regularization: str = "diag", alpha: float | None = None, asvd_alpha: float = 0.5,
             cache: bool = True, cache_dir=None, decompositions: Decompositions | None = None,
             progress: bool = False) -> Allocation:
    """Ranks of the layers ``names`` that compress the whole model by at least ``ratio``.

    Args:
        model: the model to be compressed (unchanged here).
        method: a key of :data:`fisherkron.METHODS`.
        stats: its calibration statistics (``fisher`` needs gradients or K-FAC factors).
        names: the layers to compress.
        ratio: target whole-model ratio ``1 - params_after / params_before``, in (0, 1).
        strategy: ``"uniform"``, ``"sensitivity"`` (needs ``heldout``) or ``"fisher"``.
        heldout: calibration batches not used for the statistics (``sensitivity`` only); never
            the evaluation text.
        loss_fn: ``loss_fn(model, batch)`` of the sweep (default ``model(**batch).loss``).
        loss_name: a name unique to ``loss_fn``, for the sweep's cache key in place of its
            description (needed for a loss that captures an object with state).
        sensitivity_ratios: the candidate per-layer ratios of the sweep.
        min_alpha, mff_options, regularization, alpha, asvd_alpha: as for
            :func:`fisherkron.compress`, which passes its own: the factorisation measured is
            the one that follows.
        cache, cache_dir: keep the sensitivity sweep on disk (default ``data/cache/allocation``).
        decompositions: a :class:`Decompositions` shared with the compression that follows.
        progress: tqdm bars.
    """
    if strategy not in STRATEGIES:
        raise FisherkronError(f"allocation {strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
    method_row(method)
    ratio = check_ratio(ratio)
    mods = dict(model.named_modules())
    shapes = {n: (mods[n].out_features, mods[n].in_features) for n in names}
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
        ranks = choose_ranks(curves, shapes, need)
        predicted = {n: float(curves[n][r]) if r is not None else 0.0 for n, r in ranks.items()}
        out = Allocation(strategy, method, ratio, ranks, 0, total, predicted=predicted,
                         details={"metric": metric, "curves_max_rank": {n: max_profitable_rank(*shapes[n])
                                                                         for n in names}})
    else:
        sweep = sensitivity_sweep(model, method, stats, names, heldout, ratios=sensitivity_ratios, loss_fn=loss_fn,
                                  loss_name=loss_name, cache=cache, cache_dir=cache_dir, **options)
        ranks, tau = choose_by_threshold(sweep["table"], shapes, need)
        out = Allocation(strategy, method, ratio, ranks, 0, total, evaluations=sweep["evaluations"],
                         details={"threshold": tau, "base_loss": sweep["base"], "from_cache": sweep["from_cache"],
                                  "sweep_seconds": sweep["seconds"], "cache": sweep["path"]})
    out.removed = sum(saving(*shapes[n], r) for n, r in out.ranks.items())
    out.seconds = time.perf_counter() - t0
    if out.removed < need:  # pragma: no cover - every strategy meets the budget by construction
        raise FisherkronError(f"allocation {strategy} removes {out.removed:,} < {need:,} parameters")
    return out
