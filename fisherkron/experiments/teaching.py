r"""The weighted-SVD family as pairs of transformation matrices (Sec. 5.1, Fig. connection2fwsvd, App. E).

Every method of :mod:`fisherkron.core.methods` compresses ``W`` (``n x m``, out x in) through the
one kernel of Theorem 1 / Eq. (7),

.. math:: \widetilde W = L_B^\top W L_A,\qquad
          W_r = L_B^{-\top}\,\mathrm{SVD}_r(\widetilde W)\,L_A^{-1},

and differs only in the pair ``(L_B, L_A)``: ``L_B`` (``n x n``) acts on the output side, ``L_A``
(``m x m``) on the input side. The library stores an identity as ``None`` and a diagonal as its
vector (:class:`fisherkron.core.methods.Weights`); :func:`transform_pair` writes both out as dense
matrices, so a figure or a check can show them side by side:

==============  ================================================  ===================================
method          ``L_B`` (output side)                             ``L_A`` (input side)
==============  ================================================  ===================================
``svd``         ``I_n``                                           ``I_m``
``fwsvd_rows``  ``D = diag(sqrt(sum_j E[G_ij^2]))`` (App. E)      ``I_m``
``fwsvd``       ``I_n``                                           ``C = diag(sqrt(sum_i E[G_ij^2]))``
``gfwsvd``      ``chol(B)``                                       ``chol(A)``
==============  ================================================  ===================================

The weights themselves come from :func:`fisherkron.core.methods.method_weights`; nothing is
re-derived here. Used by the teaching notebook (``notebooks/kronecker_fisher_from_scratch.py``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.checks import check_matrix
from ..core.methods import method_weights

__all__ = ["TransformPair", "dense_weight", "transform_pair", "offdiagonal_share"]


class TransformPair(NamedTuple):
    """The dense pair of one method for one layer: ``W~ = L_B^T W L_A`` (Eq. (7)).

    ``L_B`` is ``n x n`` (output side), ``L_A`` is ``m x m`` (input side), both float64;
    ``alpha_A`` / ``alpha_B`` the regularisation the Kronecker factors needed (``None`` where the
    method has no such factor).
    """

    L_B: torch.Tensor
    L_A: torch.Tensor
    alpha_A: float | None = None
    alpha_B: float | None = None


def dense_weight(weight: torch.Tensor | None, size: int) -> torch.Tensor:
    """A weight of :func:`fisherkron.weighted_svd` as a dense ``size x size`` float64 matrix.

    ``None`` is the identity, a vector the diagonal matrix it holds, a matrix itself.

    >>> dense_weight(torch.tensor([2.0, 3.0]), 2).tolist()
    [[2.0, 0.0], [0.0, 3.0]]
    >>> bool(torch.equal(dense_weight(None, 3), torch.eye(3, dtype=torch.float64)))
    True
    """
    if weight is None:
        return torch.eye(size, dtype=torch.float64)
    weight = torch.as_tensor(weight).double().cpu()
    return torch.diag(weight) if weight.ndim == 1 else weight.clone()


def transform_pair(method: str, W: torch.Tensor, *, A=None, B=None, diag_fisher=None, abs_mean=None, xxt=None,
                   kfac=None, alpha: float | None = None, layer: str = "weight", **options) -> TransformPair:
    """``(L_B, L_A)`` of ``method`` for the ``n x m`` weight ``W``, from the statistics the method reads.

    Arguments as for :func:`fisherkron.core.methods.factorize_weight` (``A``, ``B``: MFF's factors
    for the GFWSVD family; ``diag_fisher``: ``E[G * G]`` for the two FWSVD forms; ``options``: its
    ``min_alpha``, ``regularization``, ``asvd_alpha``); ``W`` is read for its shape only.

    Example:
        >>> W, G = torch.randn(7, 5), torch.randn(3, 7, 5)
        >>> pair = transform_pair("fwsvd", W, diag_fisher=(G * G).mean(0))
        >>> tuple(pair.L_B.shape), tuple(pair.L_A.shape), bool(torch.equal(pair.L_B, torch.eye(7).double()))
        ((7, 7), (5, 5), True)
    """
    W = torch.as_tensor(W)
    check_matrix(W, layer)
    n, m = W.shape
    w = method_weights(method, n, m, A=A, B=B, diag_fisher=diag_fisher, abs_mean=abs_mean, xxt=xxt, kfac=kfac,
                       alpha=alpha, layer=layer, **options)
    return TransformPair(dense_weight(w.left, n), dense_weight(w.right, m), w.alpha_A, w.alpha_B)


def offdiagonal_share(M: torch.Tensor) -> float:
    r"""``||M - diag(M)||_F / ||M||_F``: 0 for a diagonal matrix, near 1 when the off-diagonal dominates.

    >>> offdiagonal_share(torch.eye(3))
    0.0
    """
    M = torch.as_tensor(M).double()
    off = M - torch.diag(torch.diagonal(M))
    return float(off.norm() / M.norm())
