r"""Shrinking MFF's Kronecker factors toward their diagonals (beyond the paper).

MFF (Algorithm 1) estimates ``A`` (``m x m``) and ``B`` (``n x n``) from ``k`` batch gradients, so
their off-diagonal entries carry estimation noise that ``k = 32`` batches do not average away; the
paper's own ablation (App. "Impact of diagonal and non-diagonal elements") reads only the diagonals
or only the off-diagonals. The standard remedy for a noisy covariance is shrinkage toward a
structured target, here the factor's own diagonal:

.. math::  A_\lambda = (1 - \lambda) A + \lambda \operatorname{diag}(A), \qquad 0 \le \lambda \le 1 .

GFWSVD (Theorem 1) does not change when ``A`` or ``B`` is scaled, so ``A_lambda`` compresses as the
paper's ``"diag"`` regularisation ``A + alpha diag(A)`` (:func:`fisherkron.regularize`) with
``alpha = lambda / (1 - lambda)``: ``lambda = 0`` is GFWSVD, ``lambda = 1`` its diagonal ablation
``gfwsvd_diag``; the default floor ``alpha = 1e-3`` is ``lambda ~ 1e-3``.

The intensity is estimated from the gradients themselves, a Ledoit-Wolf-type rule with split halves.
For off-diagonal entries with ``E[A^_ij] = A_ij``, the expected squared error
``sum_{i != j} E[(A_lambda,ij - A_ij)^2] = (1 - lambda)^2 V + lambda^2 S`` (``V``: the summed variance
of the off-diagonal entries, ``S = sum_{i != j} A_ij^2``) is smallest at

.. math::  \lambda^* = \frac{V}{V + S} = \frac{\sum_{i \ne j} \operatorname{Var}\hat A_{ij}}
                                          {\sum_{i \ne j} E[\hat A_{ij}^2]} .

MFF run on each half of the ``k`` gradients gives ``A^(1)``, ``A^(2)``; a mean over ``k`` batches has
half the variance of a mean over ``k / 2``, so ``E[(A^(1)_ij - A^(2)_ij)^2] = 4 Var(A^_ij)`` and

.. math::  \hat\lambda = \operatorname{clip}_{[0, 1]} \frac{\sum_{i \ne j} (A^{(1)}_{ij} - A^{(2)}_{ij})^2 / 4}
                                                  {\sum_{i \ne j} \hat A_{ij}^2},

every factor first divided by its trace (MFF fixes ``A (x) B`` but not how a scalar is split between
them). The same for ``B``. It costs one more MFF per layer (two of half the gradients).
"""
from __future__ import annotations

import torch

from .checks import as_tensor, check_finite, check_square
from .conventions import FisherkronError

__all__ = ["shrink_to_diagonal", "shrinkage_alpha", "split_half_intensity"]


def shrink_to_diagonal(F, lam: float, name: str = "factor") -> torch.Tensor:
    r"""``F_lambda = (1 - lambda) F + lambda diag(F)`` of a square factor ``F`` (``lambda`` in ``[0, 1]``).

    >>> shrink_to_diagonal(torch.tensor([[2.0, 1.0], [1.0, 4.0]]), 0.25)
    tensor([[2.0000, 0.7500],
            [0.7500, 4.0000]])
    """
    F = as_tensor(F, name)
    check_square(F, name)
    lam = float(lam)
    if not 0.0 <= lam <= 1.0:
        raise FisherkronError(f"{name}: the shrinkage intensity must lie in [0, 1], got {lam}")
    return (1.0 - lam) * F + lam * torch.diag(torch.diagonal(F))


def shrinkage_alpha(lam: float) -> float:
    r"""The ``"diag"`` regularisation ``alpha`` that compresses as shrinkage ``lambda``: ``lambda / (1 - lambda)``.

    >>> shrinkage_alpha(0.5), shrinkage_alpha(0.0)
    (1.0, 0.0)
    """
    lam = float(lam)
    if not 0.0 <= lam < 1.0:
        raise FisherkronError(f"lambda = {lam} has no finite alpha; it must lie in [0, 1) (lambda = 1 is the "
                              f"diagonal alone: method gfwsvd_diag)")
    return lam / (1.0 - lam)


def _unit_trace(F: torch.Tensor, name: str) -> torch.Tensor:
    t = float(torch.diagonal(F).sum())
    if not t > 0:
        raise FisherkronError(f"{name} has trace {t:.3g}; a Kronecker factor of a Fisher has a positive trace "
                              f"(pass MFF's factors, whose sign it fixes so)")
    return F / t


def split_half_intensity(F, F1, F2, name: str = "factor") -> float:
    r"""The shrinkage intensity ``lambda^`` of a factor ``F`` from MFF's factors ``F1``, ``F2`` of the two halves.

    ``lambda^ = clip( sum_{i != j} (F1_ij - F2_ij)^2 / 4 / sum_{i != j} F_ij^2 )`` on unit-trace factors
    (see the module docstring), computed in float64. A diagonal ``F`` gives 1 (nothing to keep off the
    diagonal); identical halves give 0.

    >>> F = torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    >>> noise = torch.tensor([[0, .2], [.2, 0]], dtype=torch.float64)
    >>> split_half_intensity(F, F, F), round(split_half_intensity(F, F + noise, F), 12)
    (0.0, 0.04)
    """
    mats = []
    for X, what in ((F, name), (F1, f"{name} (first half)"), (F2, f"{name} (second half)")):
        X = as_tensor(X, what).double()
        check_square(X, what)
        check_finite(X, what)
        mats.append(_unit_trace(0.5 * (X + X.T), what))
    F, F1, F2 = mats
    if F1.shape != F.shape or F2.shape != F.shape:
        raise FisherkronError(f"{name}: the halves' factors {tuple(F1.shape)}, {tuple(F2.shape)} do not match "
                              f"{tuple(F.shape)}")
    off = ~torch.eye(F.shape[0], dtype=torch.bool, device=F.device)
    signal = float((F[off] ** 2).sum())
    if signal == 0.0:
        return 1.0
    var = float(((F1 - F2)[off] ** 2).sum()) / 4.0
    return min(max(var / signal, 0.0), 1.0)
