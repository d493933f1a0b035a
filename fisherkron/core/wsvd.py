r"""Weighted SVD compression: GFWSVD (paper Sec. 5, Theorem 1) and its special cases.

One kernel serves every method. With a left weight ``L_B`` (``n x n``, output
side) and a right weight ``L_A`` (``m x m``, input side), Theorem 1 / Eq. (7):

.. math::
    \widetilde W = L_B^\top W L_A,\quad U S V^\top = \mathrm{SVD}_r(\widetilde W),\quad
    W_1 = S^{1/2} V^\top L_A^{-1},\quad W_2 = L_B^{-\top} U S^{1/2},

so ``W_2 W_1 = L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}`` minimises
``||L_B^T (W - W_r) L_A||_F^2 = vec(W - W_r)^T (A (x) B) vec(W - W_r)`` over
rank-``r`` matrices. The weights of each method:

===========  ==========================================  ==========================================
method       left ``L_B`` (n x n)                        right ``L_A`` (m x m)
===========  ==========================================  ==========================================
SVD          ``I``                                       ``I``
FWSVD        ``I``                                       ``diag(sqrt(sum_i E[G_ij^2]))`` (public code)
FWSVD rows   ``diag(sqrt(sum_j E[G_ij^2]))`` (App. E)     ``I``
ASVD         ``I``                                       ``diag(mean|x|^alpha)``
SVD-LLM      ``I``                                       ``chol(X X^T)``
GFWSVD       ``chol(B)``                                 ``chol(A)``
===========  ==========================================  ==========================================

The two FWSVD rows read the same diagonal Fisher ``E[G * G]`` (``n x m``) and differ in the
index it is summed over. **FWSVD** (:func:`fwsvd`, method ``fwsvd``) sums over the output
index ``i`` and weights the input columns, ``W ~= SVD_r(W D) D^{-1}``: this is what the
public code does (the paper authors' BERT code, sayankotor/FisherKronecker; ASVD4LLM's
Fisher scaling), so it is the FWSVD whose numbers the paper reports. **FWSVD rows**
(:func:`fwsvd_rows`, method ``fwsvd_rows``) sums over the input index ``j`` and weights the
output rows, as App. E writes it (the best ``I_m (x) D~`` fit of the Fisher). On SmolLM2
(PTB, uniform ratios) the input form reaches perplexity 4,443 at 10 %, the row form
1,696,104.

Weights are ``None`` (identity), a vector (diagonal) or a lower-triangular
matrix (solved with triangular solves, never inverted).
"""
from __future__ import annotations

import logging

import torch

from .checks import as_tensor, check_finite, check_matrix, check_rank, check_square
from .conventions import FisherkronError
from .regularization import INDEFINITE_TOL, MIN_ALPHA, Regularized, regularize

__all__ = ["Factors", "Decomposition", "decompose", "weighted_svd", "gfwsvd", "svd", "fwsvd", "fwsvd_rows", "asvd", "svd_llm",
           "fisher_weighted_error", "transform", "diagonal_floor", "fwsvd_weight", "fwsvd_rows_weight", "asvd_weight",
           "cholesky_weight"]

log = logging.getLogger(__name__)


class Factors(tuple):
    """``(W2, W1)`` with ``W ~= W2 @ W1`` (``n x r``, ``r x m``), and the regularisation each weight needed.

    Unpacks as a pair (``W2, W1 = gfwsvd(...)``); ``alpha_A`` / ``alpha_B`` are the ``alpha`` of
    :func:`fisherkron.regularize` for the input-side / output-side factor (``None`` where the
    method has no such factor).
    """

    def __new__(cls, W2: torch.Tensor, W1: torch.Tensor, alpha_A: float | None = None,
                alpha_B: float | None = None):
        self = super().__new__(cls, (W2, W1))
        self.alpha_A, self.alpha_B = alpha_A, alpha_B
        return self

    @property
    def W2(self) -> torch.Tensor:
        return self[0]

    @property
    def W1(self) -> torch.Tensor:
        return self[1]

    @property
    def rank(self) -> int:
        return int(self[1].shape[0])

    def __repr__(self) -> str:
        return (f"Factors(W2={tuple(self[0].shape)}, W1={tuple(self[1].shape)}, "
                f"alpha_A={self.alpha_A}, alpha_B={self.alpha_B})")


def diagonal_floor(d: torch.Tensor, rel: float = 1e-6) -> torch.Tensor:
    """Clamp a positive weight vector at ``rel * mean(d)`` so it can be divided by."""
    mean = float(d.abs().mean())
    if mean == 0.0:
        raise FisherkronError("a diagonal weight is zero everywhere; it carries no information")
    return torch.clamp(d, min=rel * mean)


def _weight(Lw, size: int, name: str, dtype) -> torch.Tensor | None:
    if Lw is None:
        return None
    Lw = as_tensor(Lw, name).to(dtype)
    check_finite(Lw, name)
    if Lw.ndim == 1:
        if Lw.numel() != size:
            raise FisherkronError(f"{name} has {Lw.numel()} entries, expected {size}")
        if (Lw <= 0).any():
            raise FisherkronError(f"{name} must be positive on the diagonal; floor it first (diagonal_floor)")
        return Lw
    check_square(Lw, name, size)
    return Lw


def transform(W: torch.Tensor, left=None, right=None) -> torch.Tensor:
    """``W~ = L_B^T W L_A`` for the weights described in :func:`weighted_svd`."""
    Wt = W
    if left is not None:
        Wt = left[:, None] * Wt if left.ndim == 1 else left.T @ Wt  # (n, m)
    if right is not None:
        Wt = Wt * right[None, :] if right.ndim == 1 else Wt @ right  # (n, m)
    return Wt


def _solve_upper_T(Lw: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``Lw^{-T} X`` by a triangular solve when ``Lw`` is lower triangular, else a general solve."""
    if torch.equal(Lw, torch.tril(Lw)):
        return torch.linalg.solve_triangular(Lw.T, X, upper=True)
    return torch.linalg.solve(Lw.T, X)


class Decomposition:
    r"""The full weighted SVD of one layer, from which every rank's factors and error follow (Eq. (7)).

    With ``L_B^T W L_A = U S V^T`` (all ``q = min(n, m)`` triplets), keeps
    ``P = L_B^{-T} U`` (``n x q``), ``S`` (``q``) and ``Q = L_A^{-T} V`` (``m x q``), so that

    * the rank-``r`` factors of Theorem 1 are slices: ``W_2 = P_{:r} S_{:r}^{1/2}``,
      ``W_1 = S_{:r}^{1/2} Q_{:r}^T`` (a triangular solve acts column by column, so solving
      all ``q`` columns once and slicing equals solving ``r`` columns);
    * ``W - W_r = P_{>r} S_{>r} Q_{>r}^T``, so the error in any metric ``A (x) B`` at every rank,
      ``tr(dW_r^T B dW_r A)``, is :meth:`errors`: one pair of Gram matrices and a reverse
      cumulative sum. In the method's own metric it is Theorem 1's tail ``sum_{i>r} s_i^2``.

    One SVD then serves every rank a compression, an allocation or a sensitivity sweep asks
    for. ``alpha_A`` / ``alpha_B`` are the regularisation the weights needed.
    """

    def __init__(self, P: torch.Tensor, S: torch.Tensor, Q: torch.Tensor, out_dtype: torch.dtype,
                 alpha_A: float | None = None, alpha_B: float | None = None):
        self.P, self.S, self.Q = P, S, Q  # (n, q), (q,), (m, q)
        self.out_dtype = out_dtype
        self.alpha_A, self.alpha_B = alpha_A, alpha_B

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.P.shape[0]), int(self.Q.shape[0])

    def factors(self, rank: int, name: str = "weight") -> Factors:
        """``(W2, W1)`` of rank ``rank`` (Eq. (7)), in the weight's dtype."""
        n, m = self.shape
        rank = check_rank(rank, n, m, name)
        s = self.S[:rank].sqrt()
        W2 = self.P[:, :rank] * s[None, :]  # (n, r): L_B^{-T} U S^1/2
        W1 = s[:, None] * self.Q[:, :rank].T  # (r, m): S^1/2 V^T L_A^{-1}
        return Factors(W2.to(self.out_dtype), W1.to(self.out_dtype), alpha_A=self.alpha_A, alpha_B=self.alpha_B)

    def errors(self, A=None, B=None) -> torch.Tensor:
        r"""``e[r] = tr(dW_r^T B dW_r A)`` for ``r = 0..q`` (``None``: identity metric); float64, ``e[q] = 0``.

        ``dW_r = sum_{i>r} p_i s_i q_i^T``, so ``e[r] = sum_{i,j>r} (S P^T B P S)_{ij} (Q^T A Q)_{ij}``.
        """
        P, Q = self.P * self.S[None, :], self.Q  # (n, q), (m, q)
        dev = P.device
        G1 = P.T @ P if B is None else P.T @ torch.as_tensor(B).double().to(dev) @ P  # (q, q)
        G2 = Q.T @ Q if A is None else Q.T @ torch.as_tensor(A).double().to(dev) @ Q  # (q, q)
        E = G1 * G2
        rev = torch.flip(E, (0, 1)).cumsum(0).cumsum(1)  # rev[a, b] = sum of E[q-1-a:, q-1-b:]
        tail = torch.flip(torch.diagonal(rev), (0,))  # tail[r] = sum_{i, j >= r} E[i, j]
        return torch.cat([tail, torch.zeros(1, dtype=tail.dtype, device=dev)]).clamp_min(0.0).cpu()

    def __repr__(self) -> str:
        n, m = self.shape
        return f"Decomposition(n={n}, m={m}, alpha_A={self.alpha_A}, alpha_B={self.alpha_B})"


def decompose(W, left=None, right=None, *, dtype: torch.dtype = torch.float64, name: str = "weight",
              alpha_A: float | None = None, alpha_B: float | None = None) -> Decomposition:
    r"""The full weighted SVD of ``W`` (``n x m``) with weights ``L_B`` (``left``) and ``L_A`` (``right``).

    ``L_B^T W L_A = U S V^T``; returns :class:`Decomposition` holding ``L_B^{-T} U``, ``S`` and
    ``L_A^{-T} V`` in ``dtype`` (float64 default). Weights as in :func:`weighted_svd`.
    """
    W = as_tensor(W, name)
    out_dtype = W.dtype if W.is_floating_point() else torch.float32
    check_matrix(W, name)
    check_finite(W, name)
    n, m = W.shape
    W = W.to(dtype)
    LB = _weight(left, n, f"{name}: left weight L_B", dtype)
    LA = _weight(right, m, f"{name}: right weight L_A", dtype)
    if LB is not None:
        LB = LB.to(W.device)
    if LA is not None:
        LA = LA.to(W.device)
    Wt = transform(W, LB, LA)  # (n, m): L_B^T W L_A
    U, S, Vh = torch.linalg.svd(Wt, full_matrices=False)  # (n, q), (q,), (q, m)
    P, Q = _inv_T(LB, U), _inv_T(LA, Vh.T)  # (n, q): L_B^{-T} U, (m, q): L_A^{-T} V
    return Decomposition(P, S, Q, out_dtype, alpha_A=alpha_A, alpha_B=alpha_B)


def _inv_T(Lw: torch.Tensor | None, X: torch.Tensor) -> torch.Tensor:
    """``Lw^{-T} X`` for a weight ``Lw``: ``None`` (identity), a vector (diagonal) or a matrix."""
    if Lw is None:
        return X
    if Lw.ndim == 1:
        return X / Lw[:, None]
    return _solve_upper_T(Lw, X)


def weighted_svd(W, rank: int, left=None, right=None, *, dtype: torch.dtype = torch.float64,
                 name: str = "weight") -> Factors:
    r"""The weighted-SVD kernel, Eq. (7): ``W_2 W_1 = L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}``.

    Args:
        W: ``(n, m)`` weight (out x in).
        rank: ``r`` in ``1..min(n, m)``.
        left: ``L_B``: ``None`` (identity), a length-``n`` positive vector, or an ``n x n``
            (lower-triangular) matrix.
        right: ``L_A``: ``None``, a length-``m`` positive vector, or an ``m x m`` matrix.
        dtype: computation dtype (float64 default); the factors are returned in ``W``'s dtype.
        name: layer name for error messages.

    Returns:
        ``(W2, W1)``: ``W2`` is ``(n, r)``, ``W1`` is ``(r, m)``, ``W ~= W2 @ W1``. For several
        ranks of one weight, :func:`decompose` once and slice with :meth:`Decomposition.factors`.

    Example:
        >>> W = torch.randn(7, 5)
        >>> W2, W1 = weighted_svd(W, 5)   # full rank: exact
        >>> bool(torch.allclose(W2 @ W1, W, atol=1e-5))
        True
    """
    W = as_tensor(W, name)
    check_matrix(W, name)
    check_rank(rank, *W.shape, name)
    return decompose(W, left, right, dtype=dtype, name=name).factors(rank, name)


def cholesky_weight(F, size: int, name: str, alpha=None, method: str = "diag",
                    min_alpha: float = MIN_ALPHA, indefinite_tol: float = INDEFINITE_TOL) -> Regularized:
    """A Kronecker factor (or ``X X^T``) regularised until it has a Cholesky factor ``L`` (the weight).

    A factor that is no curvature (see :func:`fisherkron.regularize`, ``indefinite_tol``) is refused.
    """
    return _chol(F, size, name, alpha, method, min_alpha, indefinite_tol)


def _chol(F, size: int, name: str, alpha, method: str, min_alpha: float,
          indefinite_tol: float = INDEFINITE_TOL) -> Regularized:
    if isinstance(F, Regularized):
        check_square(F.L, name, size)
        return F
    F = as_tensor(F, name)
    check_square(F, name, size)
    reg = regularize(F, alpha=alpha, method=method, min_alpha=min_alpha, indefinite_tol=indefinite_tol, name=name)
    if reg.alpha > 0:
        log.debug("%s: alpha=%.3g (%s) for a Cholesky factor", name, reg.alpha, method)
    return reg


def gfwsvd(W, A, B, rank: int, *, alpha: float | None = None, method: str = "diag",
           min_alpha: float = MIN_ALPHA, name: str = "weight") -> Factors:
    r"""GFWSVD (Theorem 1, Eq. (7)): rank-``r`` ``W ~= W2 W1`` optimal for ``F ~= A (x) B``.

    ``W~ = L_B^T W L_A``, ``U S V^T = SVD_r(W~)``, ``W1 = S^1/2 V^T L_A^{-1}``,
    ``W2 = L_B^{-T} U S^1/2`` with ``A = L_A L_A^T`` (``m x m``, input side) and
    ``B = L_B L_B^T`` (``n x n``, output side).

    GFWSVD owns the regularisation (Sec. 5, "Singularity"): ``A`` and ``B`` are passed
    through :func:`fisherkron.regularize` with ``alpha`` searched from ``min_alpha``
    (default :data:`~fisherkron.core.regularization.MIN_ALPHA`) unless ``alpha`` is given,
    and the ``alpha`` each needed is returned on the :class:`Factors`. Theorem 1's
    optimum is for the factors actually used; ``min_alpha=0`` gives the optimum for
    ``A (x) B`` itself whenever both are positive definite. Pass
    :class:`~fisherkron.Regularized` objects to control the regularisation fully.
    """
    W = as_tensor(W, name)
    check_matrix(W, name)
    n, m = W.shape
    check_rank(rank, n, m, name)
    regA = _chol(A, m, f"{name}: A (input side, m x m)", alpha, method, min_alpha)
    regB = _chol(B, n, f"{name}: B (output side, n x n)", alpha, method, min_alpha)
    W2, W1 = weighted_svd(W, rank, left=regB.L, right=regA.L, name=name)
    return Factors(W2, W1, alpha_A=regA.alpha, alpha_B=regB.alpha)


def svd(W, rank: int, *, name: str = "weight") -> Factors:
    """Truncated SVD: ``W2 = U S^1/2``, ``W1 = S^1/2 V^T`` (identity weights)."""
    return weighted_svd(W, rank, name=name)


def fwsvd(W, diag_fisher, rank: int, *, name: str = "weight") -> Factors:
    r"""FWSVD (Hsu et al. 2022) as the public code runs it: input columns weighted, ``W ~= SVD_r(W D) D^{-1}``.

    ``D = diag(d)`` with ``d_j = sqrt(sum_i E[G_ij^2])`` (length ``m``: the diagonal Fisher summed
    over the output index ``i``); ``min ||(W - W2 W1) D||_F`` over rank ``r``, i.e. GFWSVD with
    ``A = D^2`` (``m x m``) and ``B = I``. The paper's FWSVD numbers come from code that weights
    this side (the authors' BERT code, sayankotor/FisherKronecker; ASVD4LLM's Fisher scaling);
    App. E states the output-row form, :func:`fwsvd_rows`.

    Args:
        W: ``(n, m)`` weight (out x in).
        diag_fisher: ``(n, m)`` diagonal Fisher ``E[G * G]``; the sum over ``i`` is taken here
            (a reduced vector is refused: its axis could not be checked on a square layer).
        rank: ``r`` in ``1..min(n, m)``.
        name: layer name for error messages.

    Example:
        >>> W, G = torch.randn(7, 5), torch.randn(3, 7, 5)
        >>> W2, W1 = fwsvd(W, (G * G).mean(0), 2)
        >>> tuple(W2.shape), tuple(W1.shape)
        ((7, 2), (2, 5))
    """
    W = as_tensor(W, name)
    check_matrix(W, name)
    return weighted_svd(W, rank, right=fwsvd_weight(diag_fisher, tuple(W.shape), name=name), name=name)


def fwsvd_rows(W, diag_fisher, rank: int, *, name: str = "weight") -> Factors:
    r"""FWSVD as paper App. E states it: output rows weighted, ``W ~= D^{-1} SVD_r(D W)``.

    ``D = diag(d)`` with ``d_i = sqrt(sum_j E[G_ij^2])`` (length ``n``: the diagonal Fisher summed
    over the input index ``j``); ``min ||D (W - W2 W1)||_F``, i.e. GFWSVD with ``A = I`` and
    ``B = D^2`` (``n x n``), the weights of the best ``I_m (x) D~`` fit of the Fisher (App. E).
    Not what the public FWSVD code runs (that is :func:`fwsvd`); kept to compare the two.

    Args:
        W: ``(n, m)`` weight (out x in).
        diag_fisher: ``(n, m)`` diagonal Fisher ``E[G * G]``; the sum over ``j`` is taken here.
        rank: ``r`` in ``1..min(n, m)``.
        name: layer name for error messages.
    """
    W = as_tensor(W, name)
    check_matrix(W, name)
    return weighted_svd(W, rank, left=fwsvd_rows_weight(diag_fisher, tuple(W.shape), name=name), name=name)


def _diagonal_fisher_sums(diag_fisher, dim: int, shape: tuple[int, int] | None, method: str,
                          name: str) -> torch.Tensor:
    """``sqrt`` of the diagonal Fisher ``E[G * G]`` (``n x m``) summed over ``dim``, floored so it can be divided by."""
    D = as_tensor(diag_fisher, "diag_fisher").double()
    if D.ndim != 2:
        raise FisherkronError(f"{method} for {name} reads the (n, m) diagonal Fisher E[G * G], got shape "
                              f"{tuple(D.shape)}; pass the matrix, not its row or column sums")
    if shape is not None and tuple(D.shape) != tuple(shape):
        raise FisherkronError(f"{method} for {name}: diag_fisher has shape {tuple(D.shape)}, expected "
                              f"{tuple(shape)} (the weight's n x m, out x in)")
    check_finite(D, "diag_fisher")
    if (D < 0).any():
        raise FisherkronError(f"{method} for {name}: diag_fisher must be non-negative (means of squared gradients)")
    return diagonal_floor(D.sum(dim=dim).sqrt())


def fwsvd_weight(diag_fisher, shape: tuple[int, int] | None = None, *, name: str = "weight") -> torch.Tensor:
    """FWSVD's right (input-side) weight ``d_j = sqrt(sum_i E[G_ij^2])`` (length ``m``), floored.

    ``diag_fisher`` is the ``(n, m)`` ``E[G * G]``; ``shape``, when given, is the weight's ``(n, m)``.
    """
    return _diagonal_fisher_sums(diag_fisher, 0, shape, "fwsvd", name)  # (m,)


def fwsvd_rows_weight(diag_fisher, shape: tuple[int, int] | None = None, *, name: str = "weight") -> torch.Tensor:
    """App. E FWSVD's left (output-side) weight ``d_i = sqrt(sum_j E[G_ij^2])`` (length ``n``), floored."""
    return _diagonal_fisher_sums(diag_fisher, 1, shape, "fwsvd_rows", name)  # (n,)


def asvd_weight(input_abs_mean, alpha: float = 0.5) -> torch.Tensor:
    """ASVD's right weight ``mean_t |x_t|^alpha`` (length ``m``), floored so it can be divided by."""
    s = as_tensor(input_abs_mean, "input_abs_mean").double()
    check_finite(s, "input_abs_mean")
    if s.ndim != 1:
        raise FisherkronError(f"input_abs_mean must be a vector of length m, got shape {tuple(s.shape)}")
    return diagonal_floor(s.abs() ** alpha)


def asvd(W, input_abs_mean, rank: int, alpha: float = 0.5, *, name: str = "weight") -> Factors:
    r"""ASVD (Yuan et al. 2023): right weight ``S = diag(mean_t |x_t|^alpha)``; ``W ~= (W S)_r S^{-1}``."""
    return weighted_svd(W, rank, right=asvd_weight(input_abs_mean, alpha), name=name)


def svd_llm(W, XXt, rank: int, *, alpha: float | None = None, method: str = "diag",
            min_alpha: float = MIN_ALPHA, name: str = "weight") -> Factors:
    r"""SVD-LLM (Wang et al. 2024): whitening ``S = chol(X X^T)``; ``W ~= SVD_r(W S) S^{-1}``.

    Truncation-aware: ``||(W - W_r) X||_F`` is minimised. ``X X^T`` (``m x m``) is
    regularised as GFWSVD's factors are (same ``alpha`` search and floor); the ``alpha`` is
    returned as ``alpha_A``.
    """
    W = as_tensor(W, name)
    check_matrix(W, name)
    check_rank(rank, *W.shape, name)
    reg = _chol(XXt, W.shape[1], f"{name}: X X^T (m x m)", alpha, method, min_alpha)
    W2, W1 = weighted_svd(W, rank, right=reg.L, name=name)
    return Factors(W2, W1, alpha_A=reg.alpha)


def fisher_weighted_error(W, W_hat, A, B) -> float:
    r"""``vec(dW)^T (A (x) B) vec(dW) = tr(dW^T B dW A)`` for ``dW = W - W_hat``.

    Shapes: ``W`` and ``W_hat`` ``n x m`` (out x in), ``A`` ``m x m`` (input side), ``B`` ``n x n``
    (output side); anything else is refused in one line naming them.
    """
    W, W_hat = as_tensor(W, "W"), as_tensor(W_hat, "W_hat")
    A, B = as_tensor(A, "A"), as_tensor(B, "B")
    check_matrix(W, "W (n x m)")
    n, m = W.shape
    want = f"expected W and W_hat n x m, A m x m and B n x n with n={n}, m={m} from W"
    for X, what, shape in ((W_hat, "W_hat", (n, m)), (A, "A", (m, m)), (B, "B", (n, n))):
        if tuple(X.shape) != shape:
            raise FisherkronError(f"fisher_weighted_error: {what} has shape {tuple(X.shape)}; {want}")
    for X, what in ((W, "W"), (W_hat, "W_hat"), (A, "A"), (B, "B")):
        if X.is_complex() or X.dtype == torch.bool:
            raise FisherkronError(f"fisher_weighted_error: {what} holds {X.dtype} values; pass real numbers")
    dW = (W - W_hat).double()
    return float(torch.trace(dW.T @ B.double() @ dW @ A.double()))
