r"""The one vectorisation convention of fisherkron (stated here, referred to everywhere).

A linear layer ``y = W x`` stores ``W`` as an ``n x m`` matrix (out x in, the
``nn.Linear.weight`` layout). Per-batch gradients ``G_i`` have the same shape.

* ``vec`` is **column-major**: ``vec(W)[i + n j] = W[i, j]``.
* The empirical Fisher of the layer, ``F = (1/k) sum_i vec(G_i) vec(G_i)^T``
  (``nm x nm``), is approximated by a Kronecker product

  .. math:: F \approx A \otimes B, \qquad A \in \mathbb{R}^{m\times m}
            \text{ (input side)},\quad B \in \mathbb{R}^{n\times n}
            \text{ (output side)},

  so that for a perturbation ``dW``

  .. math:: \operatorname{vec}(dW)^\top (A\otimes B)\operatorname{vec}(dW)
            = \operatorname{tr}(dW^\top B\, dW A)
            = \lVert L_B^\top dW L_A \rVert_F^2 ,

  with ``A = L_A L_A^T`` and ``B = L_B L_B^T`` (Cholesky factors).
* The Van Loan-Pitsianis rearrangement ``R`` maps ``A (x) B`` to the rank-one
  matrix ``vec(A) vec(B)^T`` (``m^2 x n^2``); hence
  ``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` and
  ``R(F) vec(Z) = vec((1/k) sum_i G_i^T Z G_i)`` for ``Z`` (``n x n``).
"""
from __future__ import annotations

import torch

from .errors import FisherkronError

__all__ = ["vec", "unvec", "kron", "FisherkronError"]


def vec(X: torch.Tensor) -> torch.Tensor:
    """Column-major vectorisation: ``vec(X)[i + rows * j] = X[i, j]``.

    >>> vec(torch.tensor([[1, 2], [3, 4]])).tolist()
    [1, 3, 2, 4]
    """
    return X.transpose(-1, -2).reshape(*X.shape[:-2], -1)


def unvec(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`vec`: a ``rows x cols`` matrix from its column-major vector."""
    return x.reshape(*x.shape[:-1], cols, rows).transpose(-1, -2)


def kron(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Dense ``A (x) B`` (only for small tests and teaching)."""
    return torch.kron(A, B)
