r"""The parameter budget of a compression: what a model holds, and uniform ranks that meet a target (paper Sec. 6).

The compression ratio is the paper's, over the whole model: ``1 - params_after / params_before``.
A rank-``r`` factorisation of an ``n x m`` layer keeps ``r (n + m)`` of its ``n m`` weights
(:mod:`fisherkron.core.lowrank`), so a per-layer ratio ``rho`` gives the largest ``r`` with
``1 - r (n + m) / (n m) >= rho`` (:func:`~fisherkron.core.lowrank.rank_for_ratio`).

* :func:`count_params`: the parameters of a model (tied weights counted once);
* :func:`plan_ranks`: per-layer ranks from one rank, a dict, or a whole-model ratio met by one
  uniform per-layer ratio (bisection).

Both :mod:`fisherkron.hf.allocation` (the ``"uniform"`` strategy and every strategy's budget)
and :mod:`fisherkron.hf.surgery` read them from here.
"""
from __future__ import annotations

import math
import numbers

from torch import nn

from ..core.checks import check_rank
from ..core.conventions import FisherkronError
from ..core.lowrank import rank_for_ratio

__all__ = ["count_params", "plan_ranks", "check_ratio"]


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def check_ratio(ratio) -> float:
    """``ratio`` as a float in ``(0, 1)``, or the one-line error naming what was given.

    >>> check_ratio(0.25)
    0.25
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (math.isfinite(ratio)
                                                                               and 0.0 < ratio < 1.0):
        raise FisherkronError(f"ratio must be a number in (0, 1), the fraction of the model's parameters "
                              f"removed; got {ratio!r}")
    return float(ratio)


def plan_ranks(model: nn.Module, names: list[str], *, rank: int | None = None,
               ranks: dict[str, int] | None = None, ratio: float | None = None) -> dict[str, int]:
    """Per-layer ranks from exactly one of ``rank``, ``ranks`` (``None``: keep dense) or a whole-model ``ratio``.

    With ``ratio``, every selected layer gets ``rank_for_ratio(n, m, rho)`` with
    the smallest uniform ``rho`` whose total removal reaches
    ``ratio * count_params(model)`` (``1 - r (n + m) / (n m) >= rho`` per layer).

    >>> model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    >>> plan_ranks(model, ["0", "1"], ratio=0.3)
    {'0': 2, '1': 2}
    """
    if sum(x is not None for x in (rank, ranks, ratio)) != 1:
        raise FisherkronError("give exactly one of rank=, ranks= or ratio=")
    mods = dict(model.named_modules())
    shape = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    if rank is not None:
        out = {n: rank for n in names}
    elif ranks is not None:
        unknown = [n for n in ranks if n not in shape]
        if unknown:
            raise FisherkronError(f"ranks names layer {unknown[0]}, which is not among the selected layers")
        missing = [n for n in names if n not in ranks]
        if missing:
            raise FisherkronError(f"ranks gives no rank for layer {missing[0]} ({len(missing)} missing)")
        out = dict(ranks)
    else:
        ratio = check_ratio(ratio)
        need = ratio * count_params(model)

        def plan(rho):
            return {n: rank_for_ratio(*shape[n], rho) for n in names}

        def removed(p):
            return sum(shape[n][0] * shape[n][1] - p[n] * sum(shape[n]) for n in names)

        best = removed(plan(1.0 - 1e-12))
        if best < need:
            total = count_params(model)
            raise FisherkronError(f"ratio {ratio:.3f} is out of reach: factorising the {len(names)} selected "
                                  f"layers at rank 1 removes at most {best / total:.3f} of the model; "
                                  f"select more layers")
        lo, hi = 0.0, 1.0 - 1e-12
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if removed(plan(mid)) >= need else (mid, hi)
        out = plan(hi)
    return {n: None if r is None else check_rank(r, *shape[n], name=f"layer {n}") for n, r in out.items()}
