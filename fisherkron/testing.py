"""Dense float64 references and named tolerances for tests and teaching (small sizes only).

These build the objects the matrix-free code never forms, straight from their
definitions, so the fast paths can be checked against them.
"""
from __future__ import annotations

import torch

from .core.conventions import vec

__all__ = ["FLOAT64", "FLOAT32", "dense_fisher", "dense_rearrangement", "kronecker_gradients"]

#: float64 arithmetic on well-conditioned small problems: round-off only.
FLOAT64 = dict(rtol=1e-10, atol=1e-12)
#: float32 GEMMs accumulated in float64: ~1e-7 per entry, grown by the sums.
FLOAT32 = dict(rtol=1e-4, atol=1e-6)


def dense_fisher(G: torch.Tensor) -> torch.Tensor:
    """``F = (1/k) sum_i vec(G_i) vec(G_i)^T`` (``nm x nm``) for ``G`` of shape ``(k, n, m)``."""
    g = vec(G.double())  # (k, n m)
    return g.T @ g / G.shape[0]


def dense_rearrangement(F: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Van Loan-Pitsianis ``R(F)`` (``m^2 x n^2``) by moving entries one by one.

    ``R[j + m j', i + n i'] = F[i + n j, i' + n j']``, so ``R(A (x) B) = vec(A) vec(B)^T``.
    """
    R = torch.empty(m * m, n * n, dtype=F.dtype)
    for j in range(m):
        for jp in range(m):
            for i in range(n):
                for ip in range(n):
                    R[j + m * jp, i + n * ip] = F[i + n * j, ip + n * jp]
    return R


def kronecker_gradients(A0: torch.Tensor, B0: torch.Tensor) -> torch.Tensor:
    """``k = nm`` gradients whose empirical Fisher is exactly ``A0 (x) B0`` (both SPD).

    With ``L = chol(A0) (x) chol(B0)`` and ``g_i = sqrt(k) L e_i``:
    ``(1/k) sum_i g_i g_i^T = L L^T = A0 (x) B0``.
    """
    m, n = A0.shape[0], B0.shape[0]
    L = torch.kron(torch.linalg.cholesky(A0), torch.linalg.cholesky(B0))  # (nm, nm)
    k = n * m
    g = (k ** 0.5) * L.T  # (k, nm): row i is g_i
    return g.reshape(k, m, n).transpose(1, 2).contiguous()  # unvec each row: (k, n, m)
