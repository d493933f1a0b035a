r"""The authors' approach to MFF, restated from its description (our code), as the speed baseline.

``scipy.sparse.linalg.svds(k=3)`` over a ``LinearOperator`` whose matvec loops in Python
over the gradients, with one numpy product chain ``G_i^T Z G_i`` per gradient (Sec. 4.1,
the matvec of ``R(F)``). As in the authors' published scripts, the gradients are kept in
float32 while the operator's dtype is left to scipy, which infers float64 (the matvec
returns a float64 accumulator), so ARPACK's vectors and every product are float64.
``dtype=np.float32`` runs the same algorithm entirely in float32.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse.linalg as spla
import torch

from ..core.conventions import FisherkronError

__all__ = ["AuthorsResult", "authors_mff"]


@dataclass
class AuthorsResult:
    """Result of :func:`authors_mff`. ``status``: "measured" or "stopped" (time limit hit)."""

    A: np.ndarray | None
    B: np.ndarray | None
    sigma: float
    matvecs: int
    seconds: float
    status: str


class _Deadline(Exception):
    pass


def authors_mff(grads, svd_k: int = 3, time_limit: float | None = None, seed: int = 0,
                dtype: str = "float64") -> AuthorsResult:
    r"""The authors' approach: ``svds(k=3)`` over a per-gradient Python-loop ``LinearOperator``.

    ``matvec(vec Z) = vec((1/k) sum_i G_i^T Z G_i)`` and
    ``rmatvec(vec Y) = vec((1/k) sum_i G_i Y G_i^T)`` (column-major ``vec``),
    each a Python loop with two numpy products per gradient. ``dtype``: the
    operator's dtype. ``"float64"`` (default) is what the authors' scripts
    run: float32 gradients, a float64 accumulator, so scipy infers a float64
    operator and every product is computed in float64; ``"float32"`` keeps
    everything in float32 (a faster variant of the same algorithm). The
    leading triplet gives ``A = sqrt(s) mat(u)``, ``B = sqrt(s) mat(v)``. With
    ``time_limit`` the solver is interrupted once that many seconds have
    passed (``status="stopped"``; ``matvecs`` and ``seconds`` then describe
    the part that ran).
    """
    G = grads.detach().cpu().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads)
    if dtype not in ("float64", "float32"):
        raise FisherkronError(f"authors_mff: dtype must be 'float64' or 'float32', got {dtype!r}")
    op_dtype = np.dtype(dtype)
    if dtype == "float32":
        G = G.astype(np.float32, copy=False)
    k, n, m = G.shape
    count = [0]
    t0 = time.perf_counter()

    def tick():
        count[0] += 1
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            raise _Deadline

    def matvec(z):
        Z = np.asarray(z, dtype=op_dtype).reshape(n, n, order="F")
        out = np.zeros((m, m), dtype=op_dtype)
        for Gi in G:
            out += Gi.T @ Z @ Gi
        tick()
        return (out / k).ravel(order="F")

    def rmatvec(y):
        Y = np.asarray(y, dtype=op_dtype).reshape(m, m, order="F")
        out = np.zeros((n, n), dtype=op_dtype)
        for Gi in G:
            out += Gi @ Y @ Gi.T
        tick()
        return (out / k).ravel(order="F")

    op = spla.LinearOperator((m * m, n * n), matvec=matvec, rmatvec=rmatvec, dtype=op_dtype)
    try:
        u, s, vt = spla.svds(op, k=svd_k, rng=np.random.default_rng(seed))
    except _Deadline:
        return AuthorsResult(None, None, float("nan"), count[0], time.perf_counter() - t0, "stopped")
    seconds = time.perf_counter() - t0
    top = int(np.argmax(s))
    A = math.sqrt(s[top]) * u[:, top].reshape(m, m, order="F")
    B = math.sqrt(s[top]) * vt[top].reshape(n, n, order="F")
    if np.trace(A) < 0:
        A, B = -A, -B
    return AuthorsResult(A, B, float(s[top]), count[0], seconds, "measured")


# ----------------------------------------------------------------------------- measurement helpers
