r"""Per-layer rank allocation under a parameter budget: the predicted error curves and the choice.

The paper compresses its Llama models with per-layer ranks from ASVD's sensitivity procedure
and names the lack of coordination across layers as its main limitation. Theorem 1 gives
the coordination for free: for GFWSVD the error at rank ``r`` is exactly

.. math::  \operatorname{tr}(\Delta W^\top B\,\Delta W A) = \sum_{i>r} \tilde s_i^2,
           \qquad \tilde s = \operatorname{svd}(L_B^\top W L_A),

the second-order loss increase (Eq. (1)-(2)) under the Kronecker Fisher ``A (x) B``.
:func:`truncation_errors` evaluates that curve for any weighted SVD (its own weights ``L_B``,
``L_A``) in any Kronecker metric, for every rank at once; :func:`choose_ranks` minimises the
summed curves under a parameter budget; :func:`choose_by_threshold` is ASVD's threshold
search over measured sensitivities.

Every layer may also stay dense: at ranks with ``r (n + m) >= n m`` a factorised layer saves
nothing, so the options of a layer are ranks ``1..r_max`` (``r_max (n + m) < n m``) and dense.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping

import numpy as np
import torch

from .wsvd import decompose
from .conventions import FisherkronError

__all__ = ["truncation_errors", "max_profitable_rank", "choose_ranks", "choose_by_threshold", "saving"]


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


def choose_ranks(curves: Mapping[str, np.ndarray | torch.Tensor], shapes: Mapping[str, tuple[int, int]],
                 need: int) -> dict[str, int | None]:
    """Ranks minimising ``sum_l e_l[r_l]`` subject to ``sum_l saving_l(r_l) >= need`` (``None`` = dense).

    ``curves[l][r]`` is layer ``l``'s predicted error at rank ``r`` (index 0 unused). Solved by a
    Lagrangian relaxation (each layer picks ``argmin_r e[r] - lambda * saving(r)``, ``lambda``
    bisected to the smallest value meeting the budget), then a greedy pass that gives back
    rank where it buys the most error per parameter while the budget still holds, so the
    budget is met as tightly as the layer sizes allow.
    """
    names = list(curves)
    if not names:
        raise FisherkronError("no layers to allocate ranks to")
    opts = {}
    for nm in names:
        n, m = shapes[nm]
        rmax = max_profitable_rank(n, m)
        e = np.asarray(curves[nm], dtype=np.float64)
        if rmax < 1:
            opts[nm] = (np.zeros(1), np.zeros(1), [None])
            continue
        if len(e) <= rmax:
            raise FisherkronError(f"curve of layer {nm} has {len(e)} entries; ranks up to {rmax} are needed")
        err = np.concatenate([e[1:rmax + 1], [0.0]])  # ranks 1..rmax, then dense
        sav = np.array([n * m - r * (n + m) for r in range(1, rmax + 1)] + [0], dtype=np.float64)
        opts[nm] = (err, sav, list(range(1, rmax + 1)) + [None])
    most = sum(float(v[1].max()) for v in opts.values())
    if most < need:
        raise FisherkronError(f"the budget asks to remove {need:,} parameters, but rank 1 everywhere removes "
                              f"only {int(most):,}; select more layers or a smaller ratio")

    def pick(lam: float) -> dict[str, int]:
        return {nm: int(np.argmin(err - lam * sav)) for nm, (err, sav, _) in opts.items()}

    def removed(choice) -> float:
        return sum(opts[nm][1][i] for nm, i in choice.items())

    if need <= 0:
        return {nm: None for nm in names}
    hi = 1.0
    while removed(pick(hi)) < need:
        hi *= 4.0
        if hi > 1e300:  # pragma: no cover - rank 1 everywhere meets any reachable budget
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
    choice = pick(hi)
    total = removed(choice)
    # greedy give-back: move a layer one option up (more rank, or dense) while the budget holds
    heap = []

    def push(nm):
        err, sav, _ = opts[nm]
        i = choice[nm]
        if i + 1 < len(err):
            gain, cost = err[i] - err[i + 1], sav[i] - sav[i + 1]
            heapq.heappush(heap, (-(gain / cost) if cost > 0 else -np.inf, nm, i))
    for nm in names:
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
    return {nm: opts[nm][2][i] for nm, i in choice.items()}


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
