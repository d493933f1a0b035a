r"""Model surgery: replace selected ``nn.Linear`` layers by ``LowRankLinear`` (paper Secs. 5-6).

Each selected ``W`` (``n x m``) becomes ``W_2 W_1`` (``n x r``, ``r x m``) by one of the
methods of :data:`fisherkron.core.methods.METHODS` (SVD, FWSVD, ASVD, SVD-LLM, GFWSVD and
the appendix ablations ``gfwsvd_diag`` / ``gfwsvd_offdiag``), dispatched through
:func:`fisherkron.core.methods.decompose_weight`. For the GFWSVD family this module runs
MFF (Algorithm 1) on the layer's calibration gradients, warm-started from K-FAC when the
calibration collected it.

Ranks: one rank for every layer (the BERT protocol), a per-layer dict, or a
target whole-model compression ratio ``1 - params_after / params_before``
met by a uniform per-layer ratio (:mod:`fisherkron.hf.budget`) or allocated across layers
(:mod:`fisherkron.hf.allocation`). Imports run one way: surgery -> allocation -> budget.

Called without a method, :func:`compress` runs the recommended recipe,
:data:`fisherkron.hf.allocation.RECOMMENDED` (KFAC-SVD; for a target ratio, the KL-calibrated
allocation), whose docstring states the rule that chose it and the studies it rests on.

Only dense ``nn.Linear`` layers are factorised. In a model compressed before, each
``LowRankLinear`` is selected by a layer pattern as the layer it stands for and left as it
is (the report's ``already_lowrank``, and a warning); a selection of such layers alone is
refused.

A compression never makes a model larger and never runs out of memory where that can be
told in advance (:mod:`fisherkron.hf.budget`): a layer whose weight another module holds
(an ``lm_head`` tied to the input embeddings) is left dense with a warning, or refused when
``layers`` names it; a layer whose factors cannot fit in memory is refused (or kept dense,
``skip_large_layers=True``) before any factorisation; a plan that would leave more
parameters than the model has is refused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch import nn
from tqdm.auto import tqdm

from ..core.checks import check_int, check_positive
from ..core.conventions import FisherkronError
from ..core.basis_sharing import SharedBasisLinear
from ..core.lowrank import LowRankLinear, lowrank_params

#: the modules a compression leaves: a layer already one of these is not factorised again
FACTORISED = (LowRankLinear, SharedBasisLinear)
from ..core.methods import method as method_row
from ..core.phases import timed
from ..core.regularization import MIN_ALPHA
from . import speed
from .allocation import (GFWSVD_RECIPE, RECOMMENDED, Allocation, Decompositions, Recipe, allocate, check_options,
                         describe)
from .budget import (RatioReport, check_factor_memory, check_ratio, count_params, drop_shared, params_after,
                     plan_ranks)
from .calibration import CalibrationStats, select_layers

__all__ = ["compress", "plan_ranks", "count_params", "CompressionReport", "LayerReport", "Recipe", "RECOMMENDED",
           "GFWSVD_RECIPE"]

log = logging.getLogger(__name__)
#: what a report keeps of an allocation's details (``{key there: key in the report}``): what it measured, the
#: Kronecker factors of its curves, how its ranks were solved
_REPORTED = {k: k for k in ("calibrate_metric", "calibrate_ratio", "kl_temperature", "depth_gamma", "solver", "optimal",
                            "threshold", "from_cache")} | {"metric": "fisher_factors"}

@dataclass
class LayerReport:
    """What happened to one layer. ``alpha_*`` are the regularisation strengths each factor needed."""

    name: str
    n: int
    m: int
    rank: int | None
    params_before: int
    params_after: int
    skipped: str | None = None
    alpha_A: float | None = None
    alpha_B: float | None = None
    fisher_share: float | None = None
    mff_matvecs: int | None = None
    mff_converged: bool | None = None
    seconds: float = 0.0
    speedup: float | None = None  # measured dense / factorised time (with min_speedup=)


@dataclass
class CompressionReport(RatioReport):
    """Parameter counts of the whole model and of the selected layers, before and after, and what ran.

    ``allocation`` is the strategy that chose the ranks (``"uniform"`` for ``rank=``, ``ranks=``
    or a uniform ratio), ``allocation_details`` what it measured (``calibrate_metric``,
    ``calibrate_ratio``, ...), ``recipe`` ``"recommended"`` when the method and allocation are
    :data:`~fisherkron.hf.allocation.RECOMMENDED`'s (whether asked for by name or by default).
    """

    method: str
    params_before: int
    params_after: int
    layer_params_before: int
    layer_params_after: int
    layers: dict[str, LayerReport] = field(default_factory=dict)
    target_ratio: float | None = None
    seconds: float = 0.0
    allocation: str = "uniform"
    allocation_cost: dict | None = None
    already_lowrank: dict[str, int] = field(default_factory=dict)  # selected layers left as they were: name -> rank
    allocation_details: dict = field(default_factory=dict)
    recipe: str | None = None

    @property
    def ranks(self) -> dict[str, int]:
        return {k: v.rank for k, v in self.layers.items() if v.skipped is None}

    def __str__(self) -> str:
        alphas = [a for lr in self.layers.values() for a in (lr.alpha_A, lr.alpha_B) if a is not None]
        done = sum(lr.skipped is None for lr in self.layers.values())
        s = (f"{describe(self.method, self.allocation, self.allocation_details.get('calibrate_metric'))}"
             f"{' (the recommended recipe)' if self.recipe == 'recommended' else ''}: "
             f"{done}/{len(self.layers)} layers factorised; model {self.params_before:,} -> "
             f"{self.params_after:,} params (ratio {self.ratio:.2%}); layers {self.layer_params_before:,} -> "
             f"{self.layer_params_after:,} (ratio {self.layers_ratio:.2%})")
        if alphas:
            s += f"; alpha max {max(alphas):.3g}, {sum(a > 0 for a in alphas)}/{len(alphas)} factors needed one"
        if self.already_lowrank:
            s += f"; {len(self.already_lowrank)} selected layers were low-rank already and left as they were"
        return s


def _dense_view(model: nn.Module) -> nn.Module:
    """A shell of ``model``'s module tree (no weights) in which each ``LowRankLinear`` is the ``nn.Linear`` it replaced.

    Layer patterns are matched on it, so a pattern names the layers of the model as it was
    before any compression, and never the two halves of a factorised layer.
    """
    shell = nn.Module()
    shell.config = getattr(model, "config", None)  # the default pattern depends on the model type
    made: dict[str, nn.Module] = {"": shell}
    for name, mod in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if not name or parent not in made or isinstance(made[parent], nn.Linear):
            continue  # the root, or inside a linear layer (the halves of a LowRankLinear)
        if isinstance(mod, (nn.Linear, *FACTORISED)):
            made[name] = nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta")
        else:
            made[name] = nn.Module()
        made[parent].add_module(leaf, made[name])
    return shell


def _select(model: nn.Module, layers, low: dict[str, int]) -> list[str]:
    """:func:`select_layers` on :func:`_dense_view`; a pattern naming only halves of factorised layers selects those."""
    if not low:
        return select_layers(model, layers)
    view = _dense_view(model)
    chosen: set[str] = set()
    for pattern in [layers] if layers is None or isinstance(layers, str) else list(layers):
        try:
            chosen.update(select_layers(view, pattern))
        except FisherkronError as err:  # does it name W_1 or W_2 of a factorised layer?
            try:
                halves = select_layers(model, pattern)
            except FisherkronError:
                raise err from None
            chosen.update(n.rpartition(".")[0] for n in halves)
    return [n for n, _ in view.named_modules() if n in chosen]


def _selected_layers(model: nn.Module, layers, stats: CalibrationStats | None) -> tuple[list[str], dict[str, int]]:
    """The dense layers ``compress`` factorises, and the selected ones that are low-rank already (name -> rank).

    ``layers`` (patterns, as for :func:`~fisherkron.hf.calibration.select_layers`) or, when it is
    ``None`` and ``stats`` are given, the layers of the statistics. Refuses in one line a
    selection that holds no dense layer.
    """
    mods = dict(model.named_modules())
    low = {n: m.rank for n, m in mods.items() if isinstance(m, FACTORISED)}
    if layers is None and stats is not None:
        names = list(stats.layers)
        lost = [n for n in names if n not in low and not isinstance(mods.get(n), nn.Linear)]
        if lost:
            raise FisherkronError(f"layer {lost[0]} of the statistics is not an nn.Linear of this model; "
                                  f"collect the statistics on this model")
        what = "the layers of the statistics"
    else:
        names = _select(model, layers, low)
        what = f"layer pattern {layers!r}" if layers is not None else "the default layers"
    already = {n: low[n] for n in names if n in low}
    dense = [n for n in names if n not in low]
    if dense:
        dense = drop_shared(model, dense, layers)  # a tied lm_head: untying it would make the model larger
    if not dense:
        shown = ", ".join(f"{n} (rank {r})" for n, r in list(already.items())[:3])
        raise FisherkronError(f"{what}: the {len(already)} selected layer(s) are low-rank already ({shown}"
                              f"{', ...' if len(already) > 3 else ''}); this model was compressed before: "
                              f"compress the original model, or select dense nn.Linear layers")
    if already:
        log.warning("%d of the selected layers are low-rank already and are left as they are: %s%s", len(already),
                    ", ".join(list(already)[:5]), ", ..." if len(already) > 5 else "")
    return dense, already


def _resolve(method, stats, layers, ratio, allocation) -> tuple[str, CalibrationStats | None, object, object, bool]:
    """``(method, stats, layers, allocation, by_default)``: the arguments as given, or the recommended recipe's.

    ``compress(model, stats, ...)`` (no method) shifts the positional arguments; a method left
    out is :data:`RECOMMENDED`'s, and so is the allocation of a target ``ratio`` when it is left
    out too; a method named keeps the uniform allocation unless one is named (as before).
    """
    if isinstance(method, CalibrationStats):  # compress(model, stats[, layers])
        if layers is not None:
            raise FisherkronError("compress(model, stats, layers, ...) takes no fourth positional argument; pass "
                                  "the method by name: compress(model, 'gfwsvd', stats, layers, ...)")
        if isinstance(stats, CalibrationStats):
            raise FisherkronError("the statistics were given twice (as the second argument and as stats=)")
        method, stats, layers = None, method, stats
    if method is not None:
        return method, stats, layers, allocation, False
    if allocation is None and ratio is not None:
        allocation = RECOMMENDED.allocation
    return RECOMMENDED.method, stats, layers, allocation, True


def _recipe_needs(stats: CalibrationStats | None, row) -> None:
    """The one-line error when the recommended recipe, run by default, lacks its statistics."""
    try:
        if stats is None:
            raise FisherkronError("no calibration statistics were given")
        for stat in row.needs:
            stats._need(stat)
    except FisherkronError as err:
        raise FisherkronError(f"compress() without a method runs the recommended recipe ({RECOMMENDED.describe()}), "
                              f"which reads the statistics {', '.join(map(repr, row.needs))}: {err}; pass stats=collect_calibration(model, "
                              f"batches, methods=['{RECOMMENDED.method}']), or name the method the statistics "
                              f"were collected for (compress(model, 'gfwsvd', stats, ...))") from None


def _layers_to_factorise(model: nn.Module, method: str, stats: CalibrationStats | None, layers, allocation,
                         factor_memory_limit: int | None, skip_large_layers: bool) -> tuple[list[str], dict[str, int]]:
    """:func:`compress`'s layers: those selected whose factors fit in memory (the others refused, or left dense
    with ``skip_large_layers``), each with statistics of this very model; and the selected layers already
    low-rank."""
    names, already = _selected_layers(model, layers, stats)
    factor_methods = (method,) + (("kfac",) if allocation in ("fisher", "calibrated") else ())
    names = check_factor_memory(model, names, factor_methods, limit=factor_memory_limit, skip=skip_large_layers,
                                calibration=False)
    if not names:
        raise FisherkronError("no selected layer is left to factorise: the factors of every one are too large "
                              "to fit in memory; select smaller layers")
    if stats is not None and layers is not None:
        missing = [n for n in names if n not in stats.layers]
        if missing:
            raise FisherkronError(f"layer {missing[0]} has no calibration statistics; collect them for it")
    if stats is not None:  # statistics of another model (other norms, say) would give a plausible-looking wrong one
        stats.check_model(model)
    return names, already


def _new_report(method: str, before: int, ratio: float | None, alloc: Allocation | None,
                already: dict[str, int]) -> CompressionReport:
    """The report :func:`compress` fills layer by layer: the method, the allocation and what it cost, whether
    this is the recommended recipe."""
    report = CompressionReport(method, before, before, 0, 0, target_ratio=ratio,
                               allocation="uniform" if alloc is None else alloc.strategy, already_lowrank=already)
    if alloc is not None:
        report.allocation_cost = {"evaluations": alloc.evaluations, "seconds": alloc.seconds,
                                  "sweep_seconds": alloc.details.get("sweep_seconds", 0.0)}
        report.allocation_details = {_REPORTED[k]: alloc.details[k] for k in _REPORTED if k in alloc.details}
    if RECOMMENDED.matches(method, report.allocation, report.allocation_details.get("calibrate_metric")):
        report.recipe = "recommended"
    return report


@timed("compression")
def compress(model: nn.Module, method: str | None = None, stats: CalibrationStats | None = None, layers=None, *,
             rank: int | None = None, ranks: dict[str, int] | None = None, ratio: float | None = None,
             regularization: str = "diag", alpha: float | None = None, min_alpha: float = MIN_ALPHA,
             asvd_alpha: float = 0.5,
             mff_options: dict | None = None, skip_unprofitable: bool = True,
             allocation=None, allocation_options: dict | None = None, decompositions=None,
             min_speedup: float | None = None, speed_tokens: int = 1024,
             skip_large_layers: bool = False, factor_memory_limit: int | None = None,
             progress: bool = False) -> CompressionReport:
    r"""Replace the selected ``nn.Linear`` layers of ``model`` in place by ``LowRankLinear``.

    GFWSVD (Theorem 1, Eq. (7)): ``W_r = L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}`` with
    ``A (x) B`` from :func:`fisherkron.mff` on the layer's ``k`` batch gradients
    (warm-started from K-FAC) and ``A``/``B`` regularised until Cholesky exists; KFAC-SVD the
    same transform with the K-FAC factors ``E[x x^T]``, ``E[delta delta^T]``.

    ``compress(model, stats, ratio=0.2, allocation_options={"heldout": batches})`` (no method)
    runs the recommended recipe, :data:`~fisherkron.hf.allocation.RECOMMENDED`: KFAC-SVD with the
    KL-calibrated allocation, which measures each layer once on the held-out batches (drawn from
    documents the calibration did not see). ``compress(model, method, stats, ...)`` as before.

    Args:
        model: the model; changed in place once every layer has been factorised
            (on an error it is left as it was).
        method: one of :data:`fisherkron.METHODS`; default ``None``: the recommended recipe's
            (``RECOMMENDED.method``), and for a target ``ratio`` with no ``allocation`` its
            allocation too. The statistics may be the second positional argument then.
        stats: calibration statistics (all methods but ``svd`` need them).
        layers: regex/glob pattern(s); default: the layers in ``stats`` (or the paper's).
            Only dense ``nn.Linear`` layers are factorised: a selected ``LowRankLinear`` (from
            an earlier compression) is left as it is and listed in ``report.already_lowrank``;
            a selection of such layers alone is refused. A layer whose weight another module
            holds (an ``lm_head`` tied to the embeddings) is left dense with a warning, or
            refused when ``layers`` names it exactly.
        rank / ranks / ratio: exactly one: a rank for every layer, ``{name: rank}``,
            or a target whole-model compression ratio.
        regularization: ``"diag"`` (``A + alpha diag A``, the paper) or ``"shrink"``.
        alpha: fixed regularisation strength (default: the smallest that works).
        min_alpha: where the search for ``alpha`` starts (default
            :data:`~fisherkron.core.regularization.MIN_ALPHA`, where its measurement is described).
        asvd_alpha: ASVD's exponent.
        mff_options: keyword arguments of :func:`fisherkron.mff` (``tol``, ``max_matvecs``, ...).
        skip_unprofitable: keep a layer dense when ``r (n + m) >= n m`` (no saving).
        allocation: with ``ratio``, how the per-layer ranks are chosen: ``"uniform"`` (the
            default when a method is named; without one, ``RECOMMENDED.allocation``),
            ``"sensitivity"`` (ASVD's measured procedure, the paper's; needs
            ``allocation_options={"heldout": batches}``), ``"fisher"`` (Theorem 1's predicted
            loss increase, no model evaluation), ``"calibrated"`` (Theorem 1's curves scaled through
            one measured point per layer, exact integer program; needs ``heldout`` too) or
            ``"lems"`` (LEMS's allocation; needs ``heldout``); or an
            :class:`~fisherkron.hf.allocation.Allocation` computed before. Layers the allocation
            keeps dense stay ``nn.Linear``.
        allocation_options: keyword arguments of :func:`fisherkron.hf.allocation.allocate` that
            compress does not set itself (:data:`~fisherkron.hf.allocation.OPTIONS`: ``heldout``,
            ``loss_fn``, ``loss_name``, ``sensitivity_ratios``, ``cache``, ``cache_dir``, and for
            ``calibrated`` / ``lems``: ``calibrate_metric``, ``calibrate_ratio``, ``kl_temperature``,
            ``depth_gamma``, ``rank_multiple``, ``solver``, ``time_limit``); the
            allocation factorises with compress's own ``regularization``, ``alpha``,
            ``min_alpha``, ``asvd_alpha`` and ``mff_options``.
        decompositions: a :class:`~fisherkron.hf.allocation.Decompositions` that keeps each
            layer's full weighted SVD, so that compressing copies of one model at several ratios
            or allocations runs one SVD per layer (default: a fresh one, used by this call only).
        min_speedup: keep a layer dense unless its factorisation runs at least this many times
            as fast as the dense layer (``1.0``: keep every layer the factorisation would slow
            down), measured on ``speed_tokens`` rows by :func:`fisherkron.hf.speed.layer_speedup`
            on the weight's device and dtype (cached per shape, rank and token count). The ranks
            are planned first, so each layer kept dense lowers the achieved ratio below ``ratio``
            (a warning says by how much; ``report.ratio`` is what was reached); the measured
            speedup is in each :class:`LayerReport`. Default ``None``: no measurement.
        speed_tokens: rows of the activations in that measurement (batch x sequence length).
        skip_large_layers: keep dense (with a warning) the layers whose factors cannot fit in
            memory; default: refuse them in one line before any factorisation
            (:func:`fisherkron.hf.budget.check_factor_memory`).
        factor_memory_limit: the bytes one layer's factors may take (default: the memory
            available when compress starts).
        progress: tqdm bar over layers.

    Returns:
        :class:`CompressionReport` with whole-model and per-layer counts and alphas, the allocation
        that ran and what it measured.
    """
    method, stats, layers, allocation, by_default = _resolve(method, stats, layers, ratio, allocation)
    row = method_row(method)
    if by_default and row.needs:
        _recipe_needs(stats, row)
    if row.needs:
        if stats is None:
            raise FisherkronError(f"method {method} needs calibration statistics: pass stats=collect_calibration(...)")
        for stat in row.needs:
            stats._need(stat)
    if min_speedup is not None:
        min_speedup = check_positive(min_speedup, "min_speedup")  # a float from here on; "1.5" is refused
        check_int(speed_tokens, "speed_tokens", minimum=1)
    if ratio is not None:
        ratio = check_ratio(ratio)
    allocation_options = check_options(allocation_options)
    t_all = time.perf_counter()
    if decompositions is None:
        decompositions = Decompositions()
    names, already = _layers_to_factorise(model, method, stats, layers, allocation, factor_memory_limit,
                                          skip_large_layers)
    alloc = None
    if allocation is not None and not (isinstance(allocation, str) and allocation == "uniform"):
        if isinstance(allocation, Allocation):
            alloc = allocation
            if set(alloc.ranks) != set(names):
                raise FisherkronError(f"the allocation covers {len(alloc.ranks)} layers, {len(names)} are selected")
        else:
            if ratio is None or rank is not None or ranks is not None:
                raise FisherkronError(f"allocation={allocation!r} chooses the ranks for a target ratio=; "
                                      f"do not give rank= or ranks=")
            alloc = allocate(model, method, stats, names, ratio=ratio, strategy=allocation, min_alpha=min_alpha,
                             mff_options=mff_options, regularization=regularization, alpha=alpha,
                             asvd_alpha=asvd_alpha, decompositions=decompositions, progress=progress,
                             **allocation_options)
        plan = dict(alloc.ranks)
    else:
        plan = plan_ranks(model, names, rank=rank, ranks=ranks, ratio=ratio)
    before = count_params(model)
    if skip_unprofitable and params_after(model, plan) > before:  # a weight shared in a way not caught above
        raise FisherkronError(f"the plan would leave {params_after(model, plan):,} parameters, more than the "
                              f"model's {before:,}: a selected layer's weights are shared with another module; "
                              f"select other layers")
    mods = dict(model.named_modules())
    report = _new_report(method, before, ratio, alloc, already)
    opts = dict(mff_options or {})
    new: dict[str, LowRankLinear] = {}
    for name in tqdm(names, desc=f"compress ({method})", disable=not progress):
        t0 = time.perf_counter()
        lin: nn.Linear = mods[name]
        W = lin.weight.detach()  # (n, m)
        n, m = W.shape
        r = plan[name]
        has_bias = lin.bias is not None
        dense = n * m + (n if has_bias else 0)
        lr = LayerReport(name, n, m, r, dense, dense)
        report.layers[name] = lr
        report.layer_params_before += dense
        if r is None:
            lr.skipped = "kept dense by the allocation" if alloc is not None else "kept dense (rank None)"
            report.layer_params_after += dense
            continue
        if skip_unprofitable and lowrank_params(n, m, r, has_bias) >= dense:
            lr.skipped = f"rank {r} saves nothing: r (n + m) >= n m"
            report.layer_params_after += dense
            continue
        if min_speedup is not None:
            lr.speedup = speed.layer_speedup(n, m, r, speed_tokens, bias=has_bias, device=W.device,
                                             dtype=W.dtype).speedup
            if lr.speedup < min_speedup:
                lr.skipped = (f"kept dense: rank {r} runs at {lr.speedup:.2f}x the dense speed < min_speedup "
                              f"{min_speedup:g} ({speed_tokens} tokens, {W.device.type})")
                report.layer_params_after += dense
                continue
        mff_info: dict = {}
        dec, _ = decompositions.get(lin, method, stats, name, mff_options=opts, alpha=alpha, min_alpha=min_alpha,
                                    regularization=regularization, asvd_alpha=asvd_alpha, info=mff_info)
        if mff_info:
            lr.fisher_share, lr.mff_matvecs, lr.mff_converged = (mff_info["fisher_share"], mff_info["matvecs"],
                                                                 mff_info["converged"])
        W2, W1 = f = dec.factors(r, name)
        lr.alpha_A, lr.alpha_B = f.alpha_A, f.alpha_B
        new[name] = LowRankLinear.from_factors(W2.to(W.dtype), W1.to(W.dtype),
                                               lin.bias.detach() if has_bias else None).to(W.device)
        lr.params_after = lowrank_params(n, m, r, has_bias)
        report.layer_params_after += lr.params_after
        lr.seconds = time.perf_counter() - t0
    # surgery only once every layer is factorised: an error above leaves the model untouched
    for name, low in new.items():
        model.set_submodule(name, low)
    report.params_after = count_params(model)
    report.seconds = time.perf_counter() - t_all
    slow = [lr for lr in report.layers.values() if lr.speedup is not None and lr.speedup < min_speedup]
    if slow and ratio is not None and report.ratio < ratio:
        log.warning("%d layers kept dense because factorising them would not speed them up (min_speedup=%g): "
                    "compression ratio %.2f%% instead of the %.2f%% planned", len(slow), min_speedup,
                    100 * report.ratio, 100 * ratio)
    expected = before - report.layer_params_before + report.layer_params_after
    if report.params_after != expected:  # shared/tied weights among the selected layers
        log.warning("model has %d params after compression, %d expected from the layer counts",
                    report.params_after, expected)
    return report
