r"""Per-layer rank allocation under a parameter budget: the predicted error curves and the choice.

The paper compresses its Llama models with per-layer ranks from ASVD's sensitivity procedure
and names the lack of coordination across layers as its main limitation. Theorem 1 gives
the coordination for free: for GFWSVD the error at rank ``r`` is exactly

.. math::  \operatorname{tr}(\Delta W^\top B\,\Delta W A) = \sum_{i>r} \tilde s_i^2,
           \qquad \tilde s = \operatorname{svd}(L_B^\top W L_A),

the second-order loss increase (Eq. (1)-(2)) under the Kronecker Fisher ``A (x) B``.
:func:`truncation_errors` evaluates that curve for any weighted SVD (its own weights ``L_B``,
``L_A``) in any Kronecker metric, for every rank at once.

The choice of ranks is a multiple-choice knapsack: layer ``l`` takes exactly one option ``c``
of a menu (candidate ranks and "dense") with a predicted cost ``e_{l,c}`` (loss increase) and
a saving ``s_{l,c}`` (parameters removed), and

.. math::  \min_x \sum_{l,c} e_{l,c} x_{l,c} \quad\text{s.t.}\quad \sum_c x_{l,c} = 1\ \forall l,
           \quad \sum_{l,c} s_{l,c} x_{l,c} \ge \text{need}, \quad x_{l,c} \in \{0, 1\}.

* :func:`knapsack` solves it exactly as an integer program (SciPy's ``milp``, HiGHS), or by
  the Lagrangian relaxation with a certified gap;
* :func:`choose_ranks` is the Lagrangian over every rank of each layer's curve (the
  ``"fisher"`` allocation's solver);
* :func:`choose_by_threshold` is ASVD's threshold search over measured sensitivities;
* :func:`scale_to_points` scales each layer's curve by one number so that it passes through one
  measured point (the ``"calibrated"`` allocation of :mod:`fisherkron.hf.allocation`);
* :func:`energy_shape` and :func:`depth_bias` are LEMS's curve shape and depth multiplier
  (Thoma et al., ICML 2026), used by :mod:`fisherkron.hf.allocation`'s ``"lems"`` baseline.

Every layer may also stay dense: at ranks with ``r (n + m) >= n m`` a factorised layer saves
nothing, so the options of a layer are ranks ``1..r_max`` (``r_max (n + m) < n m``) and dense.
"""
from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from .conventions import FisherkronError
from .wsvd import decompose

__all__ = ["truncation_errors", "max_profitable_rank", "choose_ranks", "choose_by_threshold", "saving",
           "knapsack", "RankChoice", "curve_costs", "scale_to_points", "energy_shape", "depth_bias", "SOLVERS",
           "ILP_TIME_LIMIT", "ILP_REL_GAP"]

log = logging.getLogger(__name__)

#: the solvers of :func:`knapsack`
SOLVERS = ("ilp", "lagrangian")
#: seconds HiGHS may take before :func:`knapsack` falls back to the Lagrangian. Measured on 25
#: SmolLM2-shaped instances (210 layers, 5 seeds x ratios 0.05-0.3; 2-core AMD EPYC): with ~20
#: candidates per layer proved optimal in 0.15 s median, 20 s at most; with every rank (63,630
#: binaries) 0.19 s median, 1.3 s at most
ILP_TIME_LIMIT = 60.0
#: relative gap at which HiGHS declares the integer program solved (``optimal`` means within it)
ILP_REL_GAP = 1e-5


def max_profitable_rank(n: int, m: int) -> int:
    """The largest ``r`` with ``r (n + m) < n m`` (0 if none): beyond it a factorised layer saves nothing."""
    return max(0, (n * m - 1) // (n + m))


def saving(n: int, m: int, r: int | None) -> int:
    """Parameters removed by rank ``r`` (``None``: kept dense, 0)."""
    return 0 if r is None else n * m - r * (n + m)


def truncation_errors(W, left=None, right=None, A=None, B=None) -> torch.Tensor:
    r"""``e[r] = tr(dW_r^T B dW_r A)`` for ``r = 0..q`` (``q = min(n, m)``), all ranks at once.

    ``dW_r = W - W_r`` with ``W_r = L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}``, the rank-``r`` weighted
    SVD with weights ``left = L_B`` and ``right = L_A`` (``None``, a vector or a lower-triangular
    matrix, as in :func:`fisherkron.weighted_svd`). ``A`` (``m x m``) and ``B`` (``n x n``) give
    the metric (``None``: identity). With ``P = L_B^{-T} U S`` and ``Q = L_A^{-T} V``,
    ``dW_r = P_{>r} Q_{>r}^T``, so ``e[r] = sum_{i,j>r} (P^T B P)_{ij} (Q^T A Q)_{ij}``: one SVD
    and two Gram matrices, then a reverse cumulative sum. For GFWSVD in its own metric
    (``A = L_A L_A^T``, ``B = L_B L_B^T``) this is the tail ``sum_{i>r} s_i^2`` of Theorem 1.

    Returns:
        float64 tensor of length ``q + 1``; ``e[q] = 0`` up to round-off.
    """
    return decompose(W, left, right, name="W").errors(A, B)


# ----------------------------------------------------------------------------- the knapsack

@dataclass
class RankChoice:
    """The ranks :func:`knapsack` chose (``None``: dense) and what is proved about them.

    ``cost`` is ``sum_l e_l(r_l)``; ``bound`` a proved lower bound on the optimum over the same
    menus (HiGHS's dual bound, or the Lagrangian dual ``D(lambda)``), so the choice is within
    ``gap = cost - bound`` of the optimum. ``optimal``: HiGHS proved it optimal to
    :data:`ILP_REL_GAP`. ``solver``: ``"ilp"`` where the integer program proved the ranks optimal
    or found them; ``"lagrangian"`` where the Lagrangian relaxation's ranks are used unproved.
    ``mip_gap``: HiGHS's relative gap when it stopped.
    """

    ranks: dict[str, int | None]
    cost: float
    bound: float
    removed: int
    solver: str
    optimal: bool
    seconds: float
    mip_gap: float | None = None

    @property
    def gap(self) -> float:
        """``cost - bound`` (>= 0 up to round-off): how far the choice can be from the optimum."""
        return max(0.0, self.cost - self.bound)

    @property
    def rel_gap(self) -> float:
        """:attr:`gap` relative to ``|cost|`` (0 when both are 0)."""
        return self.gap / abs(self.cost) if self.cost else 0.0


def curve_costs(curves: Mapping[str, np.ndarray | torch.Tensor], shapes: Mapping[str, tuple[int, int]],
                ranks: Mapping[str, list[int]] | None = None) -> dict[str, dict[int | None, float]]:
    """Menus of :func:`knapsack` from curves: ``{layer: {rank: curves[layer][rank], None: 0.0}}``.

    Every profitable rank ``1..r_max`` of each layer, or the ranks ``ranks[layer]`` (unprofitable
    ones dropped); "dense" (``None``) costs 0.
    """
    out = {}
    for nm, e in curves.items():
        n, m = shapes[nm]
        rmax = max_profitable_rank(n, m)
        e = np.asarray(e, dtype=np.float64)
        want = range(1, rmax + 1) if ranks is None else sorted({int(r) for r in ranks[nm] if 1 <= r <= rmax})
        if want and len(e) <= max(want):
            raise FisherkronError(f"curve of layer {nm} has {len(e)} entries; ranks up to {max(want)} are needed")
        menu = {r: float(e[r]) for r in want}
        menu[None] = 0.0
        out[nm] = menu
    return out


def _menus(costs: Mapping[str, Mapping[int | None, float]], shapes: Mapping[str, tuple[int, int]]) -> dict:
    """``{layer: (cost, saving, labels)}``: options by rising rank, "dense" last (cost 0 unless given)."""
    if not costs:
        raise FisherkronError("no layers to allocate ranks to")
    opts = {}
    for nm, menu in costs.items():
        n, m = shapes[nm]
        ranks = []
        for r in menu:
            if r is None:
                continue
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= min(n, m):
                raise FisherkronError(f"candidate rank {r!r} of layer {nm} is not an integer in 1..{min(n, m)}")
            if saving(n, m, int(r)) > 0:
                ranks.append(int(r))
        ranks.sort()
        labels = ranks + [None]
        err = np.array([float(menu[r]) for r in ranks] + [float(menu.get(None, 0.0))], dtype=np.float64)
        if not np.isfinite(err).all():
            raise FisherkronError(f"the predicted costs of layer {nm} are not all finite")
        sav = np.array([saving(n, m, r) for r in labels], dtype=np.float64)
        opts[nm] = (err, sav, labels)
    return opts


def _lagrangian(opts: dict, need: int) -> tuple[dict[str, int], float, float]:
    """Bisected Lagrangian relaxation: ``(option indices, dual bound D, its lambda)``.

    Each layer picks ``argmin_c e_c - lambda s_c``; ``lambda`` is bisected to the smallest value
    whose picks remove ``need`` (the indices returned are these picks). ``D(lambda) = lambda need
    + sum_l min_c (e_c - lambda s_c)`` is a lower bound on the optimum for every ``lambda >= 0``
    (weak duality); the larger of its values at the two ends of the bisection is returned.
    """
    def pick(lam: float) -> dict[str, int]:
        return {nm: int(np.argmin(err - lam * sav)) for nm, (err, sav, _) in opts.items()}

    def removed(choice) -> float:
        return sum(opts[nm][1][i] for nm, i in choice.items())

    hi = 1.0
    while removed(pick(hi)) < need:
        hi *= 4.0
        if hi > 1e300:  # pragma: no cover - the lowest option everywhere meets any reachable budget
            raise FisherkronError("rank allocation did not converge")
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if removed(pick(mid)) >= need:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    bound, lam = max((_dual(opts, need, x), x) for x in (lo, hi))
    return pick(hi), bound, lam


def _dual(opts: dict, need: int, lam: float) -> float:
    """``D(lambda) = lambda need + sum_l min_c (e_{l,c} - lambda s_{l,c})``, a lower bound on the optimum."""
    return lam * need + sum(float(np.min(err - lam * sav)) for err, sav, _ in opts.values())


def _give_back(opts: dict, choice: dict[str, int], need: int) -> dict[str, int]:
    """Greedy give-back: move a layer one option up (more rank, or dense) while the budget holds,
    where it buys the most error per parameter and never raises the error; ``choice`` is updated."""
    total = sum(opts[nm][1][i] for nm, i in choice.items())
    heap = []

    def push(nm):
        err, sav, _ = opts[nm]
        i = choice[nm]
        if i + 1 < len(err):
            gain, cost = err[i] - err[i + 1], sav[i] - sav[i + 1]
            heapq.heappush(heap, (-(gain / cost) if cost > 0 else -np.inf, nm, i))
    for nm in choice:
        push(nm)
    while heap:
        _, nm, i = heapq.heappop(heap)
        if choice[nm] != i:
            continue
        err, sav, _ = opts[nm]
        cost = sav[i] - sav[i + 1]
        if err[i] - err[i + 1] < 0 or total - cost < need:
            continue
        choice[nm], total = i + 1, total - cost
        push(nm)
    return choice


def _check_reachable(opts: dict, need: int, what: str) -> None:
    most = sum(float(v[1].max()) for v in opts.values())
    if most < need:
        raise FisherkronError(f"the budget asks to remove {need:,} parameters, but {what} removes only "
                              f"{int(most):,}; select more layers or a smaller ratio")


def choose_ranks(curves: Mapping[str, np.ndarray | torch.Tensor], shapes: Mapping[str, tuple[int, int]],
                 need: int, *, info: dict | None = None) -> dict[str, int | None]:
    r"""Ranks minimising ``sum_l e_l[r_l]`` subject to ``sum_l saving_l(r_l) >= need`` (``None`` = dense).

    ``curves[l][r]`` is layer ``l``'s predicted error at rank ``r`` (index 0 unused). Solved by a
    Lagrangian relaxation (each layer picks ``argmin_r e[r] - lambda * saving(r)``, ``lambda``
    bisected to the smallest value meeting the budget), then a greedy pass that gives back
    rank where it buys the most error per parameter while the budget still holds, so the
    budget is met as tightly as the layer sizes allow.

    How far from the optimum (the gap is provable, and reported): for every ``lambda >= 0``,
    ``D(lambda) = lambda need + sum_l min_r (e_l[r] - lambda saving_l(r))`` is a lower bound on
    the optimum (weak duality). The picks at the upper end ``lambda+`` of the bisection cost
    exactly ``D(lambda+) + lambda+ (removed+ - need)``, and the give-back only lowers that, so the
    ranks are within ``lambda+ (removed+ - need)`` of the optimum. ``removed+ - need`` is less than
    the summed saving steps of the layers whose pick changes inside the final bisection interval
    (``lambda+ - lambda- <= 1e-12 lambda+``), between adjacent points of their lower convex
    hulls: generically one layer, and for convex curves (Theorem 1's tails ``sum_{i>r} s~_i^2``
    in the method's own metric) one rank step, ``n + m`` parameters. Measured on SmolLM2-shaped
    instances (210 layers, every rank) the certified gap is 3e-6 to 5e-4 of the cost.
    ``info`` (a dict) receives ``cost``, ``bound`` (the larger ``D`` of the interval's ends),
    ``gap`` (``cost - bound``: the certificate achieved) and ``lambda``; :func:`knapsack`
    solves the same problem exactly.
    """
    if not curves:
        raise FisherkronError("no layers to allocate ranks to")
    opts = _menus(curve_costs(curves, shapes), shapes)
    _check_reachable(opts, need, "rank 1 everywhere")
    if need <= 0:
        choice, bound, lam = {nm: len(v[0]) - 1 for nm, v in opts.items()}, 0.0, 0.0
    else:
        choice, bound, lam = _lagrangian(opts, need)
        choice = _give_back(opts, choice, need)
    if info is not None:
        cost = float(sum(opts[nm][0][i] for nm, i in choice.items()))
        info.update(cost=cost, bound=bound, gap=max(0.0, cost - bound), **{"lambda": lam})
    return {nm: opts[nm][2][i] for nm, i in choice.items()}


def _reduced(opts: dict, need: int, choice: dict[str, int], bound: float, lam: float) -> dict[str, np.ndarray]:
    """Reduced-cost fixing: the options that can be part of a choice cheaper than ``choice``.

    Fixing ``x_{l,c} = 1`` raises the Lagrangian bound to ``D(lambda) + rc_{l,c}`` with
    ``rc_{l,c} = (e_{l,c} - lambda s_{l,c}) - min_c' (e_{l,c'} - lambda s_{l,c'})``, so an option with
    ``D + rc > cost(choice)`` is in no choice cheaper than ``choice``; the optimum over the options
    kept is the optimum over all. Returns ``{layer: indices kept}`` (``choice``'s always among them).
    """
    upper = sum(float(opts[nm][0][i]) for nm, i in choice.items())
    tol = 1e-9 * max(abs(upper), abs(bound)) + 1e-300
    keep = {}
    for nm, (err, sav, _) in opts.items():
        red = err - lam * sav
        idx = np.flatnonzero(bound + (red - red.min()) <= upper + tol)
        keep[nm] = np.union1d(idx, [choice[nm]]).astype(int)
    return keep


@contextlib.contextmanager
def _quiet():
    """Silence what HiGHS writes to the process's stdout even with ``disp=False`` (a debug line of its MIP
    solver): file descriptor 1 goes to the null device for the solve. The core prints nothing."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no file descriptor 1 (an embedded interpreter): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _highs(opts: dict, keep: dict[str, np.ndarray], need: int, time_limit: float):
    """HiGHS on the integer program over the options ``keep``: ``(indices or None, optimal, bound, MIP gap)``.

    Each layer's costs are shifted by their minimum (a constant of the objective, since a layer
    takes exactly one option) and scaled to order one, so HiGHS's absolute tolerances do not
    swallow costs many orders below the largest.
    """
    names = [nm for nm in opts if len(keep[nm]) > 1]  # the others are fixed
    fixed = {nm: int(keep[nm][0]) for nm in opts if len(keep[nm]) == 1}
    rest = need - sum(opts[nm][1][i] for nm, i in fixed.items())
    if not names or rest <= 0:
        choice = {**fixed, **{nm: int(keep[nm][np.argmin(opts[nm][0][keep[nm]])]) for nm in names}}
        return choice, True, sum(float(opts[nm][0][i]) for nm, i in choice.items()), 0.0
    low = {nm: float(opts[nm][0][keep[nm]].min()) for nm in names}
    err = np.concatenate([opts[nm][0][keep[nm]] - low[nm] for nm in names])  # (N,): every option kept, >= 0
    sav = np.concatenate([opts[nm][1][keep[nm]] for nm in names])  # (N,)
    sizes = np.array([len(keep[nm]) for nm in names])
    scale = float(np.median(err[err > 0])) if (err > 0).any() else 1.0
    offset = sum(low.values()) + sum(float(opts[nm][0][i]) for nm, i in fixed.items())
    N = len(err) + 1  # the last variable, fixed to 1, carries the offset: HiGHS's gap is relative to the total
    one = sparse.csr_array((np.ones(N - 1), (np.repeat(np.arange(len(names)), sizes), np.arange(N - 1))),
                           shape=(len(names), N))  # (L, N): sum_c x_{l,c} = 1
    constraints = [LinearConstraint(one, 1.0, 1.0),
                   LinearConstraint(np.append(sav / rest, 0.0)[None, :], 1.0, np.inf)]
    lower, upper = np.zeros(N), np.ones(N)
    lower[-1] = 1.0
    with _quiet():
        res = milp(np.append(err, offset) / scale, integrality=np.ones(N), bounds=Bounds(lower, upper),
                   constraints=constraints,
                   options={"time_limit": float(time_limit), "mip_rel_gap": ILP_REL_GAP, "disp": False})
    bound = getattr(res, "mip_dual_bound", None)
    bound = -math.inf if bound is None or not np.isfinite(bound) else float(bound) * scale
    gap = getattr(res, "mip_gap", None)
    if res.x is None:
        return None, False, bound, gap
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    choice = {**fixed, **{nm: int(keep[nm][np.argmax(res.x[s:s + k])]) for nm, s, k in zip(names, starts, sizes)}}
    if sum(opts[nm][1][i] for nm, i in choice.items()) < need:  # pragma: no cover - HiGHS's rounding
        log.warning("HiGHS's rank choice misses the budget after rounding; it is not used")
        return None, False, bound, gap
    return choice, res.status == 0, bound, gap


def _cost(opts: dict, choice: dict[str, int]) -> float:
    """The summed cost of a choice, in the order of the layers (equal choices, equal sums)."""
    return float(sum(opts[nm][0][choice[nm]] for nm in opts))


def knapsack(costs: Mapping[str, Mapping[int | None, float]], shapes: Mapping[str, tuple[int, int]], need: int, *,
             solver: str = "ilp", time_limit: float = ILP_TIME_LIMIT) -> RankChoice:
    r"""The multiple-choice knapsack of the rank choice: one option per layer, least summed cost, budget met.

    ``costs[l]`` maps candidate ranks of layer ``l`` (and ``None``, "dense", cost 0 unless
    given) to their predicted cost; an option's saving is ``saving(n, m, r)`` with
    ``(n, m) = shapes[l]`` (ranks that save nothing are dropped). Minimises
    ``sum_{l,c} e_{l,c} x_{l,c}`` subject to ``sum_c x_{l,c} = 1`` per layer and
    ``sum_{l,c} s_{l,c} x_{l,c} >= need``, ``x`` binary.

    ``solver="lagrangian"``: the relaxation of :func:`choose_ranks` on these menus, with its
    certified gap. ``solver="ilp"``: that Lagrangian first (an upper bound and the dual bound
    ``D``), reduced-cost fixing (an option whose Lagrangian bound with it fixed exceeds the upper
    bound is in no better choice and is dropped: on 210-layer instances with every rank a
    candidate, 63,630 options become 250-1,400 in 30-80 layers), then SciPy's ``milp`` (HiGHS,
    branch and cut) on what is left, to :data:`ILP_REL_GAP`: the optimum over all the options. If HiGHS
    does not prove optimality within ``time_limit`` seconds, a warning gives its MIP gap and the
    Lagrangian's ranks are used (or HiGHS's best, if cheaper). Either way a greedy pass then
    gives back rank that raises no cost while the budget holds, so among equal-cost choices the
    budget is met as tightly as the options allow.

    Raises:
        FisherkronError: one line, when the lowest candidate of every layer removes less than
            ``need``, a solver is unknown or ``time_limit`` is not positive.
    """
    if solver not in SOLVERS:
        raise FisherkronError(f"solver {solver!r} is unknown; use one of {', '.join(SOLVERS)}")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not time_limit > 0:
        raise FisherkronError(f"time_limit must be a number of seconds > 0; got {time_limit!r}")
    t0 = time.perf_counter()
    opts = _menus(costs, shapes)
    _check_reachable(opts, need, "the lowest candidate rank of every layer")

    def result(choice, bound, used, optimal, gap=None) -> RankChoice:
        cost = _cost(opts, choice)
        return RankChoice({nm: opts[nm][2][choice[nm]] for nm in opts}, cost, min(bound, cost),
                          int(sum(opts[nm][1][i] for nm, i in choice.items())), used, optimal,
                          time.perf_counter() - t0, gap)

    if need <= 0:  # every layer at its cheapest option (dense unless a rank costs less)
        choice = _give_back(opts, {nm: int(np.argmin(v[0])) for nm, v in opts.items()}, need)
        return result(choice, sum(float(v[0].min()) for v in opts.values()), solver, True)
    lag, bound, lam = _lagrangian(opts, need)
    lag = _give_back(opts, lag, need)
    if solver == "lagrangian":
        return result(lag, bound, "lagrangian", False)
    keep = _reduced(opts, need, lag, bound, lam)
    choice, optimal, ilp_bound, gap = _highs(opts, keep, need, time_limit)
    best = lag  # HiGHS's choice where it is cheaper; where it is within HiGHS's tolerance of it, the Lagrangian's
    if choice is not None:
        choice = _give_back(opts, choice, need)
        best = choice if _cost(opts, choice) < _cost(opts, lag) else lag
    out = result(best, max(bound, ilp_bound), "ilp" if optimal or best is choice else "lagrangian", optimal, gap)
    if optimal:
        return out
    log.warning("HiGHS did not prove the rank choice optimal within %g s (MIP gap %s); using the %s ranks, "
                "within %.3g (relative %.2e) of the optimum", time_limit,
                "unknown: no solution found" if gap is None or choice is None else f"{gap:.2e}",
                "Lagrangian relaxation's" if out.solver == "lagrangian" else "HiGHS's best", out.gap, out.rel_gap)
    return out


def choose_by_threshold(sensitivity: Mapping[str, Mapping[int, float]], shapes: Mapping[str, tuple[int, int]],
                        need: int) -> tuple[dict[str, int | None], float]:
    """ASVD's allocation: the smallest threshold ``tau`` such that every layer taking its lowest
    measured rank whose loss increase is ``<= tau`` (dense if none) removes ``need`` parameters.

    ``sensitivity[l]`` maps candidate ranks of layer ``l`` to the measured loss increase of
    compressing that layer alone. Returns the ranks (``None`` = dense) and ``tau``.
    """
    def choose(tau: float) -> dict[str, int | None]:
        out = {}
        for nm, table in sensitivity.items():
            ok = [r for r, d in table.items() if d <= tau and saving(*shapes[nm], r) > 0]
            out[nm] = min(ok) if ok else None
        return out

    def removed(choice) -> int:
        return sum(saving(*shapes[nm], r) for nm, r in choice.items())

    levels = sorted({float(d) for table in sensitivity.values() for d in table.values()})
    if not levels or removed(choose(levels[-1])) < need:
        best = removed(choose(levels[-1])) if levels else 0
        raise FisherkronError(f"the measured candidate ranks remove at most {best:,} parameters, {need:,} are "
                              f"needed; add lower candidate ranks (larger per-layer ratios)")
    lo, hi = -1, len(levels) - 1  # levels[hi] meets the budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if removed(choose(levels[mid])) >= need:
            hi = mid
        else:
            lo = mid
    return choose(levels[hi]), levels[hi]


# ----------------------------------------------------------------------------- calibrated curves, LEMS

def scale_to_points(curves: Mapping[str, np.ndarray | torch.Tensor], points: Mapping[str, tuple[int, float]]
                    ) -> tuple[dict[str, np.ndarray], dict[str, float], list[str]]:
    r"""Each layer's curve times one number, so that it passes through the layer's measured point.

    ``points[l] = (r_l, d_l)``: the cost ``d_l`` measured with layer ``l`` alone at rank ``r_l``.
    Then ``c_l[r] = k_l e_l[r]`` with ``k_l = d_l / e_l[r_l]``, so ``c_l[r_l] = d_l``: the curve keeps
    its shape (Theorem 1's, in the layer's own Fisher metric) and takes its scale from the
    measurement. Where the scale is not positive (a measured decrease ``d_l <= 0``, noise of the
    held-out loss, or a curve that is 0 at ``r_l``) the smallest positive ``k`` among the layers
    is used, i.e. the layer counts as at most as sensitive, relative to its prediction, as the
    least sensitive measured layer (1 if no layer has a positive scale).

    Returns:
        ``(scaled curves, {layer: k_l}, layers that took the fallback scale)``.

    >>> c, k, fell = scale_to_points({"a": [4.0, 2.0, 0.0]}, {"a": (1, 0.5)})
    >>> c["a"].tolist(), k, fell
    ([1.0, 0.5, 0.0], {'a': 0.25}, [])
    """
    curves = {nm: np.asarray(e, dtype=np.float64) for nm, e in curves.items()}
    scale = {}
    for nm, (r, d) in points.items():
        pred = float(curves[nm][r])
        scale[nm] = float(d) / pred if pred > 0 and d > 0 and math.isfinite(d) else None
    positive = [k for k in scale.values() if k is not None and k > 0 and math.isfinite(k)]
    fallback = min(positive) if positive else 1.0
    fell = [nm for nm, k in scale.items() if k is None or not (k > 0 and math.isfinite(k))]
    for nm in fell:
        scale[nm] = fallback
    return {nm: scale[nm] * curves[nm] for nm in points}, scale, fell


# ----------------------------------------------------------------------------- LEMS's curve and depth bias

def energy_shape(S, r_ref: int, power: int = 2, floor: float = 1e-6) -> torch.Tensor:
    r"""LEMS's error shape: the tail energy of the singular values normalised at ``r_ref``.

    ``shape[r] = (sum_{i>r} s_i^p / sum_i s_i^p) / max(sum_{i>r_ref} s_i^p / sum_i s_i^p, floor)``
    for ``r = 0..q`` (``p = power``, LEMS's ``energy2``; ``floor`` its ``1e-6``), so
    ``shape[r_ref] = 1`` unless the tail there is below the floor. Scaled by one measured number
    at ``r_ref`` it passes through that measurement.

    >>> energy_shape(torch.tensor([2.0, 1.0, 1.0]), 1).tolist()
    [3.0, 1.0, 0.5, 0.0]
    """
    s = torch.as_tensor(S, dtype=torch.float64).abs() ** power  # (q,)
    q = s.numel()
    if not 0 <= r_ref <= q:
        raise FisherkronError(f"reference rank {r_ref} is outside 0..{q}")
    total = float(s.sum())
    if total <= 0:
        return torch.zeros(q + 1, dtype=torch.float64)
    tail = torch.cat([s.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)]) / total  # (q+1,)
    return tail / max(float(tail[r_ref]), floor)


def depth_bias(block: int, blocks: int, gamma: float = 5.0, alpha: float = 0.0) -> float:
    r"""LEMS's ``harmonicv2`` depth multiplier of block ``block`` (0-based) of ``blocks``.

    With ``H(b) = sum_{k=b}^{L-1} (k + 1)^{-alpha}`` (``L = blocks``), ``H_min, H_max`` the smaller
    and larger of ``H(0)`` and ``H(L-1)``, the multiplier is
    ``1 + gamma (H(b) - H_min) / max(H_max - H_min, 1e-12)``: ``1 + gamma`` for the first block,
    1 for the last. With ``alpha = 0`` (LEMS's configuration) ``H(b) = L - b``, a straight line
    from ``1 + gamma`` down to 1.

    >>> [round(depth_bias(b, 3), 6) for b in range(3)]
    [6.0, 3.5, 1.0]
    """
    if gamma < 0:
        raise FisherkronError(f"the depth bias gamma must be >= 0; got {gamma}")
    if not 0 <= block < blocks:
        raise FisherkronError(f"block {block} is outside 0..{blocks - 1}")

    def H(b: int) -> float:
        return sum(1.0 / (k + 1) ** alpha for k in range(b, blocks))

    lo, hi = sorted((H(0), H(blocks - 1)))
    return 1.0 + gamma * (H(block) - lo) / max(hi - lo, 1e-12)
