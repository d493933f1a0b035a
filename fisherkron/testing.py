r"""Dense float64 references and named tolerances for tests and teaching (small sizes only).

The references build the objects the matrix-free code never forms, straight from
their definitions, so the fast paths can be checked against them.

Every tolerance the tests use is named here with its reason. Three kinds:

* **float64 round-off** (``FLOAT64``, ``F64_REL``, ...): identities checked in
  float64 on small, well-conditioned problems; round-off is ~1e-15, so these
  leave orders of magnitude of room and still fail on any real bug.
* **float32 round-off** (:func:`float32_tol`, :func:`assert_close_f32`): a float32
  result is a sum whose summation order depends on the CPU's kernels (Intel vs
  AMD) and the thread count, so its tolerance scales with the magnitude of the
  summands and the length of the sum (the model below), never a fixed ``atol``.
* **iterative and model-level** (``MFF_*``, ``RELOAD``, ``MODEL_F32_REL``): the
  target of an iterative solver, or a bar set by the specification.

The float32 model. A sum ``s = sum_{t=1}^{L} a_t`` (an entry of a GEMM, a dot
product, a reduction) evaluated in float32 in *any* order -- sequential,
pairwise, blocked across threads, with or without FMA -- satisfies the worst-case
bound ``|fl(s) - s| <= gamma_L sum_t |a_t|``, ``gamma_L ~= L u`` with the unit
round-off ``u = EPS32 / 2`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., Sec. 3.1). Rounding errors behave as independent zero-mean
variables, so with probability at least ``1 - 2 L exp(-lambda^2 / 2)`` the error is
below ``lambda sqrt(L) u sum_t |a_t|`` (Higham & Mary 2019, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), Sec. 3). Two evaluations in different orders (the code and a reference,
or two machines) differ by at most twice that. Hence, entrywise,

.. math:: |\mathrm{got} - \mathrm{ref}| \le F_{32}\,\varepsilon_{32}\sqrt{L}\;\mathrm{scale},
          \qquad \mathrm{scale} \ge \textstyle\sum_t |a_t|,

with ``F_32 = F32_SAFETY = 8``: ``lambda = 8`` per evaluation (failure probability
``2 L e^{-32} ~ 3e-14 L`` per entry), times two evaluations, times ``u = EPS32/2``.
For ``L <= F32_SAFETY^2 = 64`` it also covers the rigorous worst case ``2 gamma_L`` (to first order).
The scale is what cancellation hides: for a Gram matrix ``X^T X`` entry ``(i, j)``
has ``sum_t |x_ti x_tj| <= ||x_i|| ||x_j|| = sqrt(diag_i diag_j)`` (:func:`gram_scale`);
for a product ``D^T X`` it is ``|D|^T |X|`` (:func:`abs_sum_scale`); for a sum of
non-negative terms it is the result itself.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .core.conventions import vec

__all__ = ["FLOAT64", "F64_REL", "PSD_SLACK", "OPT_SLACK",
           "EPS32", "EPS64", "F32_SAFETY", "float32_tol", "abs_sum_scale", "gram_scale", "linear_scale",
           "assert_close_f32", "rel_error",
           "MFF_F64_REL", "MFF_F32_REL", "MFF_REF_TOL", "RELOAD", "MODEL_F32_REL", "MONTE_CARLO_REL", "DISTINCT_REL",
           "dense_fisher", "dense_rearrangement", "kronecker_gradients"]

# ----------------------------------------------------------------------------- float64 round-off

#: float64 arithmetic on well-conditioned small problems: round-off only (~1e-15 of entries of size ~1).
FLOAT64 = dict(rtol=1e-10, atol=1e-12)
#: a float64 scalar (trace, norm, quadratic form, error, share) reached along two routes: ~1e-14 apart.
F64_REL = 1e-9
#: a float64 PSD matrix up to round-off: smallest eigenvalue >= -PSD_SLACK * largest.
PSD_SLACK = 1e-10
#: a proven float64 optimum may be matched by rivals only up to round-off: rival >= best * (1 - OPT_SLACK).
OPT_SLACK = 1e-9

# ----------------------------------------------------------------------------- float32 round-off

#: float32 machine epsilon, the spacing of floats at 1 (2**-23); the unit round-off is EPS32 / 2.
EPS32 = torch.finfo(torch.float32).eps
#: float64 machine epsilon (2**-52), for the same model applied to a long float64 sum.
EPS64 = torch.finfo(torch.float64).eps
#: lambda = 8 standard deviations per evaluation, two evaluations, u = EPS32 / 2 (module docstring).
F32_SAFETY = 8.0


def float32_tol(scale, length: int, *, eps: float = EPS32):
    """Allowed ``|got - ref|`` of a float32 sum of ``length`` terms: ``F32_SAFETY * eps * sqrt(length) * scale``.

    ``scale`` bounds ``sum_t |a_t|`` of the summands, entrywise (a tensor) or for
    all entries (a number); ``eps=EPS64`` applies the same model to a float64 sum.

    >>> float32_tol(1.0, 64) == 64 * EPS32  # at L = 64 the rigorous worst case 2 gamma_L
    True
    """
    if length < 1:
        raise ValueError(f"length of the sum must be >= 1, got {length}")
    return F32_SAFETY * eps * math.sqrt(length) * scale


def abs_sum_scale(D: torch.Tensor, X: torch.Tensor | None = None) -> torch.Tensor:
    """``|D|^T |X|`` (float64): ``sum_t |D_ti X_tj|``, the scale of the sum ``(D^T X)_ij`` (``X = D`` if omitted).

    ``D``: ``(T, n)``, ``X``: ``(T, m)`` -> ``(n, m)``. Leading dimensions are flattened into ``T``.
    """
    D = D.detach().double().reshape(-1, D.shape[-1]).abs()
    X = D if X is None else X.detach().double().reshape(-1, X.shape[-1]).abs()
    return D.T @ X


def gram_scale(M: torch.Tensor) -> torch.Tensor:
    """``sqrt(|M_ii M_jj|)``: the Cauchy-Schwarz bound of ``sum_t |x_ti x_tj|`` for a Gram matrix ``M = X^T X``.

    >>> gram_scale(torch.tensor([[4.0, -1.0], [-1.0, 9.0]])).tolist()
    [[4.0, 6.0], [6.0, 9.0]]
    """
    d = M.detach().double().diagonal().abs().sqrt()
    return torch.outer(d, d)


def _f64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double().cpu()
    return torch.from_numpy(np.array(x, dtype=np.float64))  # a copy: memory maps and scalars too


def linear_scale(x: torch.Tensor, *weights: torch.Tensor, bias: torch.Tensor | None = None):
    """Scale and length of the float32 sums in ``x W_1^T W_2^T ... + b`` (a linear layer or a factorised one).

    Returns ``(|x| |W_1|^T |W_2|^T ... + |b|, m_1 + m_2 + ... [+ 1])``: the bound on ``sum |terms|`` of
    each output (float64) and the total length of the nested sums (fan-ins, plus one for the bias).
    It bounds the round-off of any association, e.g. ``x (W_2 W_1)^T`` too.
    """
    h = x.detach().double().abs()
    length = 0
    for W in weights:
        h = h @ W.detach().double().abs().T
        length += W.shape[1]
    if bias is not None:
        h = h + bias.detach().double().abs()
        length += 1
    return h, length


def assert_close_f32(got, ref, *, length: int, scale=None, eps: float = EPS32, what: str = "value") -> float:
    """Assert ``|got - ref| <= float32_tol(scale, length)`` entrywise; return the worst ratio error / allowed.

    Args:
        got, ref: the result and its reference (tensors, arrays or numbers; compared in float64).
        length: ``L``, the number of terms of the longest float32 sum behind an entry.
        scale: ``>= sum_t |a_t|`` per entry (tensor broadcastable to ``ref``) or for all entries;
            default ``max |ref|`` (right for sums without cancellation, e.g. of squares).
        eps: ``EPS64`` for a float64 sum.
        what: name of the compared quantity, for the failure message.

    Returns:
        ``max(|got - ref| / allowed)``, the margin used (below 1 when it passes).

    >>> assert_close_f32(torch.tensor([1.0 + 1e-7]), torch.tensor([1.0]), length=4) < 1
    True
    """
    got, ref = _f64(got), _f64(ref)
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != reference shape {tuple(ref.shape)}")
    if scale is None:
        scale = ref.abs().max() if ref.numel() else torch.zeros(())
    scale = _f64(scale)
    allowed = torch.broadcast_to(float32_tol(scale, length, eps=eps), ref.shape)
    for name, x in (("result", got), ("reference", ref)):
        if not torch.isfinite(x).all():
            raise AssertionError(f"{what}: the {name} has {int((~torch.isfinite(x)).sum())} NaN/inf entries")
    err = (got - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed)  # 0/0 -> 0, x/0 -> inf
    if ratio.numel() == 0:
        return 0.0
    worst = int(ratio.argmax())
    margin = float(ratio.reshape(-1)[worst])
    if margin > 1:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref.shape)) if ref.dim() else ()
        bad = int((ratio > 1).sum())
        raise AssertionError(
            f"{what}: {bad} of {ref.numel()} entries exceed the float32 round-off bound; worst at {idx}: "
            f"got {float(got.reshape(-1)[worst]):.9g}, reference {float(ref.reshape(-1)[worst]):.9g}, "
            f"|error| {float(err.reshape(-1)[worst]):.3g} > allowed {float(allowed.reshape(-1)[worst]):.3g} "
            f"(ratio {margin:.3g}; allowed = F32_SAFETY {F32_SAFETY:g} * eps {eps:.3g} * sqrt(L={length}) * "
            f"scale {float(torch.broadcast_to(scale, ref.shape).reshape(-1)[worst]):.3g})")
    return margin


def rel_error(got, ref) -> float:
    """``||got - ref||_F / ||ref||_F`` in float64."""
    got, ref = _f64(got), _f64(ref)
    return float((got - ref).norm() / ref.norm())


# ----------------------------------------------------------------------------- iterative and model-level

#: float64 MFF (default tol 1e-10, an error *estimate*, not a bound) against the dense top triplet:
#: 100x headroom over its stopping target.
MFF_F64_REL = 1e-8
#: float32 MFF (default tol 1e-5) or float32 svds against the float64 answer, relative error of A (x) B:
#: 10x the float32 stopping target (the estimate can undershoot the error); the float32 round-off
#: floor of these small problems is ~1e-6.
MFF_F32_REL = 1e-4
#: tol of float64 MFF references: far below every tolerance they are compared with.
MFF_REF_TOL = 1e-12
#: the specification's bar for save -> load of a compressed model: logits equal to 1e-6.
RELOAD = dict(rtol=0, atol=1e-6)
#: max |change of a float32 model output| / max |output| when a layer is swapped for an exact
#: (full-rank) factorisation or the same model runs another batch layout: round-off of one
#: forward pass through LayerNorm, softmax and GEMMs (measured <= 3e-7 on the tiny models);
#: dropping a single rank of one tiny-BERT layer moves the logits by >= 1e-4.
MODEL_F32_REL = 1e-5
#: relative error of a seeded sample covariance from >= 2e4 draws: ~1/sqrt(N) ~ 0.007, so 0.05 is
#: ~7 standard errors, still far below the O(1) error of a wrong formula.
MONTE_CARLO_REL = 0.05
#: two results that must differ (different batches, different weightings) are further apart
#: than this relative Frobenius distance: above every round-off and solver tolerance here.
DISTINCT_REL = 1e-3

# ----------------------------------------------------------------------------- dense references


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
