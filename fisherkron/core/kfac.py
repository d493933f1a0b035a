r"""K-FAC factors (Martens & Grosse 2015): the classic Kronecker factorisation.

For a layer ``s = W x`` with back-propagated output gradients ``delta = dL/ds``,
a batch gradient is ``G = sum_t delta_t x_t^T`` and K-FAC approximates

.. math:: F \approx E[x x^\top] \otimes E[\delta\delta^\top]
          \cdot \tfrac{T}{k},\qquad A = E[x x^\top]\ (m\times m),\;
          B = \tfrac{T}{k} E[\delta\delta^\top]\ (n\times n),

(tokens treated as independent). It is a baseline factorisation and the warm
start of :func:`fisherkron.mff`, whose Lanczos iteration only needs its
direction.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from .checks import check_finite
from .conventions import FisherkronError

__all__ = ["KFACFactors", "kfac_factors"]


class KFACFactors(NamedTuple):
    """``F ~= A (x) B``: ``A`` (``m x m``) input covariance, ``B`` (``n x n``) output-gradient covariance."""

    A: torch.Tensor
    B: torch.Tensor


def kfac_factors(inputs, output_grads, num_batches: int | None = None) -> KFACFactors:
    r"""K-FAC: ``A = E[x x^T]``, ``B = (T/k) E[delta delta^T]`` from layer inputs and output gradients.

    Args:
        inputs: layer inputs ``x``, shape ``(..., m)``, or an iterable of such tensors (one per batch).
        output_grads: gradients w.r.t. the layer output ``delta``, shape ``(..., n)``, or an iterable
            matching ``inputs``.
        num_batches: ``k``; with it ``A (x) B`` has the scale of ``F`` (``T`` tokens over ``k`` batches).
            Without it ``B = E[delta delta^T]``.

    Example:
        >>> x, d = torch.randn(10, 4, 3), torch.randn(10, 4, 5)   # 10 batches x 4 tokens; m=3, n=5
        >>> f = kfac_factors(x, d)
        >>> f.A.shape, f.B.shape
        (torch.Size([3, 3]), torch.Size([5, 5]))
    """
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, Iterable):
        inputs, output_grads = [inputs], [output_grads]
    A = B = None
    T = 0
    for i, (x, d) in enumerate(zip(inputs, output_grads, strict=True)):
        x = torch.as_tensor(x).detach().double()
        d = torch.as_tensor(d).detach().double()
        x = x.reshape(-1, x.shape[-1])  # (T_i, m)
        d = d.reshape(-1, d.shape[-1])  # (T_i, n)
        if x.shape[0] != d.shape[0]:
            raise FisherkronError(f"batch {i}: {x.shape[0]} input rows but {d.shape[0]} output-gradient rows")
        check_finite(x, f"inputs of batch {i}")
        check_finite(d, f"output gradients of batch {i}")
        A = x.T @ x if A is None else A + x.T @ x  # (m, m)
        B = d.T @ d if B is None else B + d.T @ d  # (n, n)
        T += x.shape[0]
    if A is None or T == 0:
        raise FisherkronError("kfac_factors: no inputs were given")
    A = A / T
    B = B / (num_batches if num_batches else T)
    return KFACFactors(A, B)
