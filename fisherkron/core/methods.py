r"""The compression methods in one table: what each reads and how it factorises one weight.

Model compression (:func:`fisherkron.compress`) and the synthetic experiment (Sec. 6.1)
both dispatch through :func:`factorize_weight`, so a method means the same thing
everywhere. The statistics a method reads (``needs``) are named as the calibration
collects them:

==================  ===============  ==========================================================
method              needs            factors of ``W`` (``n x m``)
==================  ===============  ==========================================================
``svd``             --               truncated SVD
``fwsvd``           ``diag_fisher``  FWSVD as its public code runs: right weight ``diag(sqrt(sum_i E[G_ij^2]))``
``fwsvd_rows``      ``diag_fisher``  FWSVD as App. E states it: left weight ``diag(sqrt(sum_j E[G_ij^2]))``
``asvd``            ``abs_mean``     ASVD: right weight ``diag(mean|x|^alpha)``
``svd_llm``         ``xxt``          SVD-LLM: right weight ``chol(X X^T)``
``gfwsvd``          ``grads``        GFWSVD, Theorem 1 / Eq. (7), ``A (x) B`` from MFF (Alg. 1)
``gfwsvd_diag``     ``grads``        App. "Impact of diagonal and non-diagonal elements": ``diag(A), diag(B)``
``gfwsvd_offdiag``  ``grads``        same appendix: the diagonals of ``A, B`` nulled (see :func:`ablate`)
``gfwsvd_shrunk``   ``grads``        GFWSVD with ``(1 - lambda) A + lambda diag(A)`` (the same for ``B``), ``lambda``
                                     from split halves of the gradients (:mod:`fisherkron.core.shrinkage`)
``kfac_svd``        ``kfac``         Theorem 1 / Eq. (7) with the K-FAC factors ``E[x x^T]``, ``E[delta delta^T]``
==================  ===============  ==========================================================

``fwsvd`` and ``fwsvd_rows`` read the same ``E[G * G]`` and sum it over different indices;
:mod:`fisherkron.core.wsvd` says which is which and why ``fwsvd`` is the input-side one.
``grads`` are the per-batch gradients from which MFF finds ``A`` and ``B``; callers run
MFF (with whatever start and tolerance they choose) and pass the factors. ``kfac`` are the
per-token K-FAC factors (:func:`fisherkron.kfac_factors`), MFF's warm start: KFAC-SVD is the
same transform as GFWSVD with them in place of MFF's best Kronecker fit (not in the paper;
the strongest baseline we know of, so it belongs in every comparison). ``gfwsvd_shrunk`` (not in the
paper either) reads MFF's factors and the intensities ``(lambda_A, lambda_B)`` that
:func:`~fisherkron.core.shrinkage.split_half_intensity` estimates from MFF on each half of the gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


from .checks import check_matrix, check_rank
from .conventions import FisherkronError
from .regularization import MIN_ALPHA
from .shrinkage import shrink_to_diagonal
from .wsvd import Decomposition, Factors, asvd_weight, cholesky_weight, decompose, fwsvd_rows_weight, fwsvd_weight

__all__ = ["Method", "METHODS", "method", "Weights", "method_weights", "decompose_weight", "factorize_weight",
           "ablate"]


@dataclass(frozen=True)
class Method:
    """One row of the table: the method's name, the statistics it reads and what it is."""

    name: str
    needs: tuple[str, ...]
    summary: str

    @property
    def kronecker(self) -> bool:
        """True for the methods that read MFF's ``A (x) B``."""
        return "grads" in self.needs


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("svd", (), "truncated SVD"),
    Method("fwsvd", ("diag_fisher",), "FWSVD: input columns weighted by sqrt(sum_i E[G_ij^2]) (the public code)"),
    Method("fwsvd_rows", ("diag_fisher",), "FWSVD as App. E states it: output rows weighted by sqrt(sum_j E[G_ij^2])"),
    Method("asvd", ("abs_mean",), "ASVD: columns weighted by mean |x|^alpha"),
    Method("svd_llm", ("xxt",), "SVD-LLM: whitening by chol(X X^T)"),
    Method("gfwsvd", ("grads",), "GFWSVD: Theorem 1 with MFF's A (x) B"),
    Method("gfwsvd_diag", ("grads",), "GFWSVD with diag(A), diag(B) only (appendix ablation)"),
    Method("gfwsvd_offdiag", ("grads",), "GFWSVD with the diagonals of A, B nulled (appendix ablation)"),
    Method("gfwsvd_shrunk", ("grads",), "GFWSVD with A, B shrunk toward their diagonals (split-half intensity)"),
    Method("kfac_svd", ("kfac",), "KFAC-SVD: Theorem 1 with the K-FAC factors E[x x^T], E[delta delta^T]"),
)}


def ablate(F: torch.Tensor, part: str) -> tuple[torch.Tensor, float]:
    """Diagonal-only (``part="diag"``) or off-diagonal-only (``"offdiag"``) Kronecker factor.

    Off-diagonal-only factors have zero trace, so they are indefinite and no Cholesky
    factor exists. The appendix gives no regulariser for them; here the nulled diagonal
    is replaced by ``c * I`` with ``c = mean(diag F)`` (a shift that carries no per-unit
    information), and :func:`fisherkron.regularize` then raises ``alpha`` as for any factor.

    Returns:
        The factor and the identity shift added, in units of ``c`` (0 or 1).
    """
    d = torch.diagonal(F)
    if part == "diag":
        return torch.diag(d), 0.0
    if part != "offdiag":
        raise FisherkronError(f"part must be 'diag' or 'offdiag', got {part!r}")
    c = float(d.mean())
    return F - torch.diag(d) + c * torch.eye(F.shape[0], dtype=F.dtype, device=F.device), 1.0


def method(name: str) -> Method:
    """The table row of ``name``, or a one-line error listing the methods."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise FisherkronError(f"method {name!r} is unknown; use one of {', '.join(METHODS)}") from None


class Weights(NamedTuple):
    """The weights of one method for one layer: ``W~ = L_B^T W L_A`` (see :func:`fisherkron.weighted_svd`).

    ``left`` (``L_B``) and ``right`` (``L_A``) are ``None`` (identity), a vector (diagonal) or a
    lower-triangular matrix; ``alpha_A`` / ``alpha_B`` the regularisation they needed.
    """

    left: torch.Tensor | None
    right: torch.Tensor | None
    alpha_A: float | None = None
    alpha_B: float | None = None


def method_weights(name: str, n: int, m: int, *, A=None, B=None, diag_fisher=None, abs_mean=None, xxt=None,
                   kfac=None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
                   regularization: str = "diag", asvd_alpha: float = 0.5, shrinkage=None,
                   layer: str = "weight") -> Weights:
    """The weights method ``name`` uses for an ``n x m`` layer, from the statistics it needs (see the table).

    ``shrinkage``: ``(lambda_A, lambda_B)`` of ``gfwsvd_shrunk`` (ignored by every other method)."""
    meth = method(name)
    given = {"diag_fisher": diag_fisher, "abs_mean": abs_mean, "xxt": xxt, "kfac": kfac,
             "grads": None if A is None or B is None else (A, B)}
    for need in meth.needs:
        if given[need] is None:
            what = {"grads": "the Kronecker factors A and B (from MFF)", "kfac": "the K-FAC factors"}.get(need, need)
            raise FisherkronError(f"method {name} needs {what} for layer {layer}")
    reg = dict(alpha=alpha, method=regularization, min_alpha=min_alpha)
    if name == "svd":
        return Weights(None, None)
    if name == "fwsvd":
        return Weights(None, fwsvd_weight(diag_fisher, (n, m), name=layer))
    if name == "fwsvd_rows":
        return Weights(fwsvd_rows_weight(diag_fisher, (n, m), name=layer), None)
    if name == "asvd":
        return Weights(None, asvd_weight(abs_mean, asvd_alpha))
    if name == "svd_llm":
        r = cholesky_weight(xxt, m, f"{layer}: X X^T (m x m)", **reg)
        return Weights(None, r.L, alpha_A=r.alpha)
    shift = 0.0
    if name == "kfac_svd":
        A, B = kfac[0], kfac[1]
    elif name == "gfwsvd_shrunk":
        if shrinkage is None:
            raise FisherkronError(f"method gfwsvd_shrunk needs the shrinkage intensities (lambda_A, lambda_B) for "
                                  f"layer {layer} (fisherkron.core.shrinkage.split_half_intensity)")
        lam_A, lam_B = shrinkage
        A = shrink_to_diagonal(A, lam_A, f"{layer}: A")
        B = shrink_to_diagonal(B, lam_B, f"{layer}: B")
    elif name != "gfwsvd":
        part = name.removeprefix("gfwsvd_")
        (A, shift), (B, _) = ablate(torch.as_tensor(A), part), ablate(torch.as_tensor(B), part)
        if part == "offdiag":  # indefinite by construction (see ablate): regularised, not refused
            reg["indefinite_tol"] = math.inf
    rA = cholesky_weight(A, m, f"{layer}: A (input side, m x m)", **reg)
    rB = cholesky_weight(B, n, f"{layer}: B (output side, n x n)", **reg)
    return Weights(rB.L, rA.L, alpha_A=shift + rA.alpha, alpha_B=shift + rB.alpha)


def decompose_weight(name: str, W: torch.Tensor, *, A=None, B=None, diag_fisher=None, abs_mean=None, xxt=None,
                     kfac=None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
                     regularization: str = "diag", asvd_alpha: float = 0.5, shrinkage=None,
                     layer: str = "weight") -> Decomposition:
    """The full weighted SVD of ``W`` (``n x m``) by method ``name``: every rank's factors and error.

    Arguments as for :func:`factorize_weight`; ``decompose_weight(...).factors(r)`` equals
    ``factorize_weight(..., rank=r)`` (see :class:`~fisherkron.core.wsvd.Decomposition`).
    """
    W = torch.as_tensor(W)
    check_matrix(W, layer)
    n, m = W.shape
    w = method_weights(name, n, m, A=A, B=B, diag_fisher=diag_fisher, abs_mean=abs_mean, xxt=xxt, kfac=kfac,
                       alpha=alpha, min_alpha=min_alpha, regularization=regularization, asvd_alpha=asvd_alpha,
                       shrinkage=shrinkage, layer=layer)
    return decompose(W, w.left, w.right, name=layer, alpha_A=w.alpha_A, alpha_B=w.alpha_B)


def factorize_weight(name: str, W: torch.Tensor, rank: int, *, A=None, B=None, diag_fisher=None,
                     abs_mean=None, xxt=None, kfac=None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
                     regularization: str = "diag", asvd_alpha: float = 0.5, shrinkage=None,
                     layer: str = "weight") -> Factors:
    """Rank-``rank`` factors of ``W`` (``n x m``) by method ``name`` from the statistics it needs.

    Args:
        name: a key of :data:`METHODS`.
        W: ``(n, m)`` weight.
        rank: ``r`` in ``1..min(n, m)``.
        A, B: MFF's Kronecker factors (``m x m`` input side, ``n x n`` output side) for the
            GFWSVD family.
        diag_fisher: ``(n, m)`` diagonal Fisher ``E[G * G]`` for ``fwsvd`` (summed over the
            outputs) and ``fwsvd_rows`` (summed over the inputs).
        abs_mean: length-``m`` mean ``|x|`` for ASVD.
        xxt: ``m x m`` ``X X^T`` for SVD-LLM.
        kfac: K-FAC factors ``(A, B)`` (a :class:`~fisherkron.KFACFactors`) for KFAC-SVD.
        alpha, min_alpha, regularization: the regularisation of ``A``, ``B`` and ``X X^T``
            (:func:`fisherkron.regularize`).
        asvd_alpha: ASVD's exponent.
        shrinkage: ``(lambda_A, lambda_B)`` for ``gfwsvd_shrunk`` (:mod:`fisherkron.core.shrinkage`).
        layer: name used in error messages.

    Returns:
        :class:`~fisherkron.Factors` ``(W2, W1)`` with the alphas used. For ``gfwsvd_offdiag``
        the alphas include the identity shift of :func:`ablate` (``1 + alpha``, in units of
        ``mean(diag)``).
    """
    W = torch.as_tensor(W)
    check_matrix(W, layer)
    check_rank(rank, *W.shape, layer)
    return decompose_weight(name, W, A=A, B=B, diag_fisher=diag_fisher, abs_mean=abs_mean, xxt=xxt, kfac=kfac,
                            alpha=alpha, min_alpha=min_alpha, regularization=regularization,
                            asvd_alpha=asvd_alpha, shrinkage=shrinkage, layer=layer).factors(rank, layer)
