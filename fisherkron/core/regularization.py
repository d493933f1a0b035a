r"""Regularising Kronecker factors until a Cholesky factor exists (paper Sec. 5, "Singularity").

Two rules, with ``alpha`` raised (x10 per try) from 0 until ``cholesky`` succeeds:

* ``"diag"`` (the paper): ``A <- A + alpha diag(A)``; diagonal entries that are
  not positive (dead units) are floored at ``floor * mean(diag A)`` so the rule
  can always succeed;
* ``"shrink"`` (the authors' code): ``A <- (1 - alpha) A + alpha mean(diag A) I``,
  ``alpha`` in ``[0, 1]``.

The ``alpha`` used is returned, never hidden.

Factors from MFF are positive semidefinite in exact arithmetic, but round-off
leaves eigenvalues of about ``-1e-8 lambda_max``. Under the ``"diag"`` rule
those sit on nearly dead units whose diagonal is tiny, so only a large
``alpha`` would lift them. When the plain Cholesky fails and the negative
eigenvalues are that small (``|lambda_min| <= psd_tol * lambda_max``), they are
first clipped to zero (one symmetric eigendecomposition); genuinely indefinite
factors are left as they are. The clipped amount is reported too. With a positive
floor (``min_alpha``, the default) the floored factor is tried first: when it has a
Cholesky factor, ``lambda_min`` was above ``-min_alpha lambda_max``, nothing would be
refused or worth clipping, and the eigendecomposition (36x a Cholesky's time on a
4864 x 4864 float64 factor, measured beside other work) is skipped.

A Kronecker factor of a Fisher is positive semidefinite; MFF's factors of a PSD ``F`` are PSD up
to round-off and the stopping tolerance, K-FAC's exactly. A factor whose negative part is not of
that size (``lambda_min < -indefinite_tol * lambda_max``, or no positive eigenvalue at all: a
negative (semi)definite factor, e.g. one whose sign was flipped) carries no curvature that
regularisation could keep: both rules would reach a Cholesky factor only by replacing it with
their ``alpha`` term. It is refused, naming the factor (``A`` or ``B``) and its extreme
eigenvalues. This is checked only when the plain Cholesky fails, from the same symmetric
eigendecomposition the round-off clipping uses.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import as_tensor, check_finite, check_positive, check_square
from .conventions import FisherkronError

__all__ = ["MIN_ALPHA", "INDEFINITE_TOL", "Regularized", "regularize", "cholesky"]

#: The one default floor of the ``alpha`` search, used by :func:`regularize`, GFWSVD, SVD-LLM,
#: model compression and the command line. The smallest ``alpha`` that admits a Cholesky factor
#: can leave directions the calibration data never excited almost unconstrained, and ``L^{-1}``
#: then amplifies them. Measured on SmolLM2 (MLP layers of blocks 10-19, rank 256, k=4 C4
#: batches, PTB perplexity 56.8 uncompressed): 392 with the smallest alpha (1e-8), 188 / 191 /
#: 201 / 211 / 216 with floors 1e-4 / 1e-3 / 1e-2 / 0.1 / 1; plain SVD 2205
#: (``scripts/alpha_floor.py``). Pass ``min_alpha=0`` for the exact optimum of given factors.
MIN_ALPHA = 1e-3


#: Negative eigenvalues below ``-INDEFINITE_TOL * lambda_max`` make a factor no curvature (see the module
#: docstring). MFF's factors of a PSD Fisher leave PSD only by round-off and by its stopping tolerance
#: (a relative error of ``A (x) B``, 1e-5 by default); a tenth of the largest eigenvalue is far outside
#: that, and a sign-flipped or ``diag(1, -1)``-like factor is far past it.
INDEFINITE_TOL = 0.1


class Regularized(NamedTuple):
    """A regularised factor ``matrix = L L^T``, the ``alpha`` it needed and the round-off clipped.

    ``clipped`` is ``|lambda_min| / lambda_max`` of the negative eigenvalues set to zero first (0 if none).
    """

    matrix: torch.Tensor
    L: torch.Tensor
    alpha: float
    method: str
    clipped: float = 0.0


def _check_curvature(lam: torch.Tensor, name: str, indefinite_tol: float) -> None:
    """Refuse a symmetric factor with eigenvalues ``lam`` that is no curvature (see the module docstring)."""
    low, top = float(lam.min()), float(lam.max())
    if top > 0 and low >= -indefinite_tol * top:
        return
    what = (f"it has no positive eigenvalue (largest {top:.3g}): negative semidefinite" if top <= 0 else
            f"its negative part exceeds {indefinite_tol:g} of its largest eigenvalue {top:.3g}, far more than "
            f"round-off or MFF's tolerance leave")
    raise FisherkronError(f"{name} is not positive semidefinite: smallest eigenvalue {low:.3g}; {what}, so "
                          f"regularisation does not make it positive definite without replacing it; pass the "
                          f"factors from fisherkron.mff or kfac_factors (a Fisher factor is PSD; check its sign)")


def _clip_roundoff(M: torch.Tensor, psd_tol: float, eigh=None) -> tuple[torch.Tensor, float]:
    """Set round-off negative eigenvalues (``>= -psd_tol lambda_max``) of a symmetric ``M`` to zero."""
    lam, Q = torch.linalg.eigh(M) if eigh is None else eigh
    top = float(lam.max())
    if top <= 0 or float(lam.min()) >= 0 or -float(lam.min()) > psd_tol * top:
        return M, 0.0
    clipped = -float(lam.min()) / top
    Mc = (Q * lam.clamp(min=0)[None, :]) @ Q.T
    return 0.5 * (Mc + Mc.T), clipped


def cholesky(M: torch.Tensor) -> torch.Tensor | None:
    """Lower Cholesky factor of ``M`` or ``None`` when ``M`` is not numerically positive definite."""
    L, info = torch.linalg.cholesky_ex(M)
    if int(info) != 0 or not torch.isfinite(L).all() or (torch.diagonal(L) <= 0).any():
        return None
    return L


def _family(M: torch.Tensor, method: str, floor: float):
    """``(make, ceiling)``: ``make(alpha)`` is the regularised ``M`` of ``method`` (see :func:`regularize`), ``ceiling``
    the largest ``alpha`` the search tries."""
    d = torch.diagonal(M)
    scale = float(d.abs().mean())
    if method == "diag":
        dfl = torch.clamp(d, min=floor * scale)
        return (lambda a: M + a * torch.diag(dfl)), 1e12
    eye = torch.eye(M.shape[0], dtype=M.dtype, device=M.device)
    return (lambda a: (1 - a) * M + a * scale * eye), 1.0


def regularize(factor, alpha: float | None = None, method: str = "diag", *, min_alpha: float = MIN_ALPHA,
               alpha0: float = 1e-8, growth: float = 10.0, floor: float = 1e-6, psd_tol: float = 1e-6,
               indefinite_tol: float = INDEFINITE_TOL, name: str = "factor") -> Regularized:
    """Make a Kronecker factor positive definite; return it, its Cholesky factor and ``alpha``.

    Args:
        factor: symmetric ``d x d`` matrix (``A`` or ``B``); symmetrised first.
        alpha: a fixed ``alpha`` to use (raises if it does not give a Cholesky factor);
            default: search ``0, alpha0, alpha0 * growth, ...``.
        min_alpha: start the search here (default :data:`MIN_ALPHA`); ``0`` starts from the
            factor itself. Measured on MiniLM layer 0 with k=4 gradients at rank 64: relative
            Frobenius error 1.46 at ``alpha=1e-8`` against 0.78 at ``alpha=0.1``.
        method: ``"diag"`` (``A + alpha diag(A)``) or ``"shrink"`` (``(1-alpha) A + alpha mean(diag A) I``).
        psd_tol: negative eigenvalues down to ``-psd_tol * lambda_max`` count as round-off and are
            clipped before the search (only when the plain Cholesky fails); 0 disables this.
        indefinite_tol: a factor whose plain Cholesky fails is refused when its smallest eigenvalue
            is below ``-indefinite_tol * lambda_max`` or it has no positive eigenvalue (default
            :data:`INDEFINITE_TOL`; ``math.inf`` accepts any factor with a positive eigenvalue, as
            the off-diagonal ablation needs).
        name: the factor in error messages (GFWSVD passes ``"<layer>: A (input side, m x m)"``).

    Example:
        >>> r = regularize(torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64))  # singular
        >>> r.alpha > 0, bool(torch.allclose(r.L @ r.L.T, r.matrix))
        (True, True)
    """
    if method not in ("diag", "shrink"):
        raise FisherkronError(f"method must be 'diag' or 'shrink', got {method!r}")
    try:
        tol_ok = not isinstance(indefinite_tol, (str, bool)) and float(indefinite_tol) >= 0
    except (TypeError, ValueError):
        tol_ok = False
    if not tol_ok:
        raise FisherkronError(f"indefinite_tol must be a number >= 0 (math.inf: no limit), got {indefinite_tol!r}")
    M = as_tensor(factor, name).double()
    check_square(M, name)
    check_finite(M, name)
    M = 0.5 * (M + M.T)
    if float(torch.diagonal(M).abs().mean()) == 0.0:
        raise FisherkronError(f"{name} is zero on its diagonal; it carries no curvature (dead layer or no data?)")
    clipped = 0.0
    a0 = check_positive(min_alpha, "min_alpha", zero_ok=True)
    if cholesky(M) is None:
        if alpha is None and a0 > 0:  # the floor alone is often enough: no eigendecomposition then
            Ma = _family(M, method, floor)[0](a0)
            L = cholesky(Ma)
            if L is not None:  # then lambda_min(M) > -a0 lambda_max: neither refused nor clipped below
                return Regularized(Ma, L, a0, method, 0.0)
        eig = torch.linalg.eigh(M) if psd_tol > 0 else (torch.linalg.eigvalsh(M), None)
        _check_curvature(eig[0], name, indefinite_tol)
        if psd_tol > 0:
            M, clipped = _clip_roundoff(M, psd_tol, eig)
    make, ceiling = _family(M, method, floor)

    if alpha is not None:
        alpha = check_positive(alpha, "alpha", zero_ok=True)
        Ma = make(alpha)
        L = cholesky(Ma)
        if L is None:
            raise FisherkronError(f"{name}: alpha={alpha} ({method}) does not make it positive definite; "
                                  f"pass alpha=None to search")
        return Regularized(Ma, L, float(alpha), method, clipped)

    a = a0
    while True:
        Ma = make(a)
        L = cholesky(Ma)
        if L is not None:
            return Regularized(Ma, L, a, method, clipped)
        if a >= ceiling:
            raise FisherkronError(f"{name}: no alpha up to {ceiling:g} gives a Cholesky factor ({method}); "
                                  f"try method='shrink'")
        a = alpha0 if a == 0.0 else min(a * growth, ceiling)
