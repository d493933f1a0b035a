r"""Synthetic per-batch gradients with the structure of a linear layer's (the runtime study, Sec. 4.2).

``G_i = sum_t delta_t x_t^T`` over ``T`` tokens, with AR(1)-correlated inputs ``x`` and
output gradients ``delta`` that also depend on ``x``, so the Fisher is close to, but not
exactly, a Kronecker product, as for real layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.kfac import KFACFactors, kfac_factors

__all__ = ["SyntheticGradients", "ar1_cholesky", "synthetic_gradients"]


@dataclass
class SyntheticGradients:
    """``G`` (``k, n, m``) with ``G_i = delta_i^T x_i``; ``x`` (``k, T, m``), ``delta`` (``k, T, n``)."""

    G: torch.Tensor
    x: torch.Tensor
    delta: torch.Tensor

    def kfac(self) -> KFACFactors:
        """K-FAC factors of the same layer (the MFF warm start)."""
        return kfac_factors(self.x, self.delta, num_batches=self.G.shape[0])


def ar1_cholesky(d: int, rho: float, scales: torch.Tensor | None = None, device=None,
                 dtype=torch.float32) -> torch.Tensor:
    r"""Lower Cholesky factor ``L`` of ``S Toeplitz(rho^{|i-j|}) S`` in closed form (``d x d``).

    ``L[i, 0] = rho^i`` and ``L[i, j] = sqrt(1 - rho^2) rho^{i-j}`` for ``1 <= j <= i``.
    """
    i = torch.arange(d, device=device, dtype=torch.float64)
    lag = i[:, None] - i[None, :]  # (d, d)
    L = torch.where(lag >= 0, rho ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64, device=device))
    L[:, 1:] *= math.sqrt(1.0 - rho ** 2)
    if scales is not None:
        L = scales.to(L)[:, None] * L
    return L.to(dtype)


def synthetic_gradients(n: int, m: int, k: int, *, tokens: int = 128, rho: float = 0.9,
                        coupling: float = 0.5, seed: int = 0, device=None,
                        dtype: torch.dtype = torch.float32) -> SyntheticGradients:
    r"""Kronecker-like per-batch gradients of an ``n x m`` linear layer.

    Per batch ``i`` and token ``t``: ``x_t = S_x L_x z_t`` (``m``; AR(1)
    correlation ``rho`` between neighbouring inputs, scales ``S_x`` decaying
    as ``j^{-1/2}``), ``delta_t = S_d L_d z'_t + c C x_t`` (``n``; AR(1)
    correlated and, through the fixed random ``C`` (``n x m``), correlated
    with ``x``), and ``G_i = sum_t delta_t x_t^T`` (``n x m``). With
    ``c = 0`` the expected Fisher is exactly ``T E[x x^T] (x) E[delta delta^T]``;
    the coupling and the finite ``k`` make it only approximately Kronecker.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    sx = torch.arange(1, m + 1, dtype=torch.float64) ** -0.5
    sd = torch.arange(1, n + 1, dtype=torch.float64) ** -0.5
    Lx = ar1_cholesky(m, rho, sx, device, dtype)  # (m, m)
    Ld = ar1_cholesky(n, rho, sd, device, dtype)  # (n, n)
    C = torch.randn(n, m, generator=gen, device=device, dtype=dtype) / math.sqrt(m)  # (n, m)
    x = torch.randn(k, tokens, m, generator=gen, device=device, dtype=dtype) @ Lx.T  # (k, T, m)
    delta = torch.randn(k, tokens, n, generator=gen, device=device, dtype=dtype) @ Ld.T  # (k, T, n)
    if coupling:
        delta += coupling * (x @ C.T)  # (k, T, n)
    G = delta.transpose(1, 2) @ x  # (k, n, m): sum_t delta_t x_t^T
    return SyntheticGradients(G, x, delta)
