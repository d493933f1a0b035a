r"""Matrix-free Fisher Factorization, MFF (paper Sec. 4, Algorithm 1).

The best Kronecker approximation of the empirical Fisher in Frobenius norm,

.. math:: \min_{A,B}\lVert F - A\otimes B\rVert_F
          = \min_{A,B}\lVert R(F) - \mathrm{vec}(A)\mathrm{vec}(B)^\top\rVert_F ,

is the leading singular triplet ``(sigma_1, u_1, v_1)`` of the rearranged
Fisher ``R(F)`` (Van Loan & Pitsianis 1993): ``A = sqrt(sigma_1) mat(u_1)``
(``m x m``) and ``B = sqrt(sigma_1) mat(v_1)`` (``n x n``). The triplet is
found with Golub-Kahan-Lanczos bidiagonalisation on the matrix-free operator
of :mod:`fisherkron.core.operators` (the paper uses ARPACK through ``svds``).

Speed comes from needing few products: the iteration starts from the K-FAC
output factor ``B`` (or a previous solution), or by default from the identity
on the side where the first product is one symmetric GEMM (``R(I_n) =
mean G_i^T G_i`` or ``R^T(I_m) = mean G_i G_i^T``, a fraction of a full
product); it keeps full re-orthogonalisation, takes a Rayleigh-Ritz estimate
after *every* product (matvec or rmatvec), and stops once the estimated error
of ``A (x) B`` is below ``tol``. The error is estimated from the relative
changes ``c_j`` of ``A (x) B`` between consecutive estimates, which decay
geometrically once Lanczos converges: with ``q = c_j / c_{j-1}`` the remaining
error is about ``c_j q / (1 - q)``; twice that is compared with ``tol``. On the 36
MiniLM layers of ``make bench`` at ``tol = 1e-4`` the measured errors were at most 6.6e-5
(K-FAC start) and 5.4e-5 (identity start), though the estimate itself fell below the
measured error on 3 and 8 of the layers: it is an estimate, not a bound. Because ``R(F)`` maps symmetric
matrices to symmetric matrices, a symmetric start keeps every iterate
symmetric; for ``F`` positive semidefinite the leading pair is symmetric PSD
(Van Loan & Pitsianis 1993), so ``terms=1`` works in that subspace.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .checks import check_int, check_positive, check_square
from .conventions import FisherkronError
from .distributed import (agree, broadcast_int, broadcast_object, broadcast_tensor, fisher_norm_sq, resolve_group,
                          world_of)
from .operators import GradientStack, RearrangedFisher, TokenFisher, _single_thread
from .phases import timed

__all__ = ["MFFResult", "mff", "kronecker_terms", "MFF_DTYPES", "mff_dtype"]

log = logging.getLogger(__name__)

#: MFF's GEMM dtypes by the name a notebook parameter, a YAML file or a command line gives
MFF_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def mff_dtype(dtype) -> torch.dtype:
    """``dtype`` as a torch dtype: a name of :data:`MFF_DTYPES` is looked up, a torch dtype passes.

    float64 makes MFF's factors independent of the GEMMs' summation order to round-off (float32's
    differ in their 4th-5th digit between thread counts), which an exact rank allocation needs to
    pick the same ranks on every machine (``scripts/allocation_reproducibility.py``).

    >>> mff_dtype("float64"), mff_dtype(torch.float32)
    (torch.float64, torch.float32)
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in MFF_DTYPES:
        raise FisherkronError(f"MFF dtype {dtype!r}: MFF computes in {' or '.join(MFF_DTYPES)}")
    return MFF_DTYPES[dtype]


@dataclass
class MFFResult:
    """Output of :func:`mff`: ``F ~= A (x) B`` (+ further terms when ``terms > 1``).

    Attributes:
        A: ``(m, m)`` input-side factor, symmetric, sign fixed so ``tr A > 0``.
        B: ``(n, n)`` output-side factor, symmetric, sign fixed so ``tr B > 0``.
        sigma: leading singular values of ``R(F)`` (``terms`` of them).
        fisher_norm_sq: ``||F||_F^2`` from the ``k x k`` Gram matrix (nan if not computed).
        matvecs: products with ``R(F)`` or ``R(F)^T`` used.
        converged: whether the stopping rule was met before ``max_matvecs``.
        rel_change: last relative change of ``A (x) B`` between two Ritz estimates.
        error_estimate: estimated relative error of ``A (x) B`` when it stopped (see the module
            docstring; ``terms > 1``: the residual bound).
        start: the start that was used: ``"identity (B side)"``, ``"identity (A side)"`` or ``"init"``.
        residual: Lanczos residual bound ``||R^T u - sigma v|| / sigma`` of the leading triplet.
        seconds: wall time of the factorisation (setup and products, not ``||F||``);
            ``flops`` the flops of the products.
        product_seconds: wall time spent inside the products (GEMMs and gradient reads).
        executed_flops: flops the GEMMs did; below ``flops`` (the nominal ``2 k n m (n + m)``
            per product) when symmetric products skip the upper block triangle.
        terms_A, terms_B: all Kronecker terms (``F ~= sum_j A_j (x) B_j``) when ``terms > 1``.
        world_size: processes that held the gradients (``group=``; 1 for one process).
        comm_bytes: bytes this rank all-reduced in the products: ``8 (m^2 + 1)`` per product
            with ``R(F)`` and ``8 (n^2 + 1)`` per product with ``R(F)^T`` (0 for one process;
            the ``||F||`` exchange and the final broadcast of ``A``, ``B`` are not counted).
        comm_seconds: wall time of those all-reduces (included in ``product_seconds``).
    """

    A: torch.Tensor
    B: torch.Tensor
    sigma: torch.Tensor
    fisher_norm_sq: float
    matvecs: int
    converged: bool
    rel_change: float
    residual: float
    seconds: float
    flops: int
    history: list[float] = field(default_factory=list)
    product_seconds: float = float("nan")
    executed_flops: int = 0
    terms_A: list[torch.Tensor] = field(default_factory=list)
    terms_B: list[torch.Tensor] = field(default_factory=list)
    error_estimate: float = float("nan")
    start: str = "init"
    world_size: int = 1
    comm_bytes: int = 0
    comm_seconds: float = 0.0

    @property
    def fisher_share(self) -> float:
        """Share of the Fisher captured by ``A (x) B``: ``sigma_1^2 / ||F||_F^2``."""
        return float(self.sigma[0] ** 2 / self.fisher_norm_sq) if self.fisher_norm_sq > 0 else float("nan")

    @property
    def gflops(self) -> float:
        """Achieved GFLOP/s of the products over the whole call."""
        return self.flops / max(self.seconds, 1e-12) / 1e9

    @property
    def matvec_gflops(self) -> float:
        """Effective GFLOP/s of the products: nominal ``flops / product_seconds``."""
        return self.flops / max(self.product_seconds, 1e-12) / 1e9

    @property
    def executed_gflops(self) -> float:
        """GFLOP/s the GEMMs actually ran at: ``executed_flops / product_seconds``."""
        return self.executed_flops / max(self.product_seconds, 1e-12) / 1e9


#: what one Lanczos step decides (broadcast from rank 0 under a process group)
_GO, _SKIP, _STOP, _ZERO = 0, 1, 2, 3


def _local_stack(grads, group, dtype, device, memory_budget, name) -> tuple[GradientStack, int]:
    """This rank's gradients as a stack and the global ``k = sum_p k_p`` (one ``all_gather``).

    A rank may hold no gradients (an empty list or a ``(0, n, m)`` array); it learns
    ``n x m`` from the others. Every rank raises the same error if a rank's input is bad,
    the shapes disagree, or no rank holds a gradient.
    """
    stack, error = None, None
    try:
        stack = GradientStack.of(grads, dtype, device=device, memory_budget=memory_budget, name=name,
                                 allow_empty=True)
    except Exception as exc:  # noqa: BLE001 - shared below, so no rank waits for a failed one
        error = exc
    agree(group, error, f"{name}: reading the gradients")
    shapes = [None] * world_of(group)
    dist.all_gather_object(shapes, (stack.k, stack.n, stack.m), group=group)
    held = {(n, m) for k, n, m in shapes if k > 0}
    if not held:
        raise FisherkronError(f"{name}: no rank holds a gradient; give the ranks the calibration batches")
    if len(held) > 1:
        raise FisherkronError(f"{name}: the ranks hold gradients of different shapes {sorted(held)}; "
                              f"every rank must pass the same layer's gradients")
    (n, m), = held
    if stack.k == 0:
        stack = GradientStack(torch.zeros(0, n, m, dtype=dtype), dtype=dtype, device=device,
                              memory_budget=memory_budget, name=name, allow_empty=True)
    return stack, sum(k for k, _, _ in shapes)


def _sym(X: torch.Tensor) -> torch.Tensor:
    return torch.add(X, X.T).mul_(0.5)


def _start_matrix(init, n: int, device) -> torch.Tensor:
    """The Lanczos start ``Z_0`` (``n x n``, output side) from ``init``, in float64.

    The Lanczos bookkeeping (bases, norms, inner products) is always float64,
    whatever the GEMM dtype: a float32 reduction over the ``n^2`` entries of a
    factor with a wide dynamic range (K-FAC ``B`` of a real layer) is off by
    ~1e-4, which showed up as a 1e-4 floor in the error of ``A (x) B``.
    """
    if isinstance(init, str):  # "identity" (and None) never get here: mff handles them
        raise FisherkronError(f"init={init!r}: expected 'identity', K-FAC factors (A, B), an MFFResult "
                              "or an n x n matrix B")
    if isinstance(init, (tuple, list)):  # (A, B) from K-FAC or a previous solution
        init = init[1]
    init = getattr(init, "B", init)  # a KFACFactors or MFFResult
    Z0 = torch.as_tensor(init).to(device, torch.float64)
    check_square(Z0, "init (the output-side factor B)", n)
    if not torch.isfinite(Z0).all() or Z0.norm() == 0:
        raise FisherkronError("init (the output-side factor B) is zero or has NaN/inf entries")
    return Z0


class _GolubKahan:
    """Golub-Kahan-Lanczos bidiagonalisation of ``R`` with full re-orthogonalisation.

    ``R V_j = U_j B_j`` with ``B_j`` upper bidiagonal (``alpha`` on the
    diagonal, ``beta`` above it). The projected matrix ``U^T R V`` is read off
    after every product; its SVD gives the Ritz triplets.
    """

    def __init__(self, op: RearrangedFisher, Z0: torch.Tensor, symmetric: bool, identity: bool = False):
        self.op, self.symmetric = op, symmetric
        Z0 = Z0.double()
        v = Z0 / Z0.norm()
        self.identity = identity  # Z0 is a multiple of I: the first product is one symmetric GEMM
        self.V = [v]  # right basis: (n, n) matrices (B side)
        self.U: list[torch.Tensor] = []  # left basis: (m, m) matrices (A side)
        self.alpha: list[float] = []
        self.beta: list[float] = []
        self.breakdown = False

    @staticmethod
    def _orth(w: torch.Tensor, basis: list[torch.Tensor]) -> torch.Tensor:
        """Modified Gram-Schmidt in place with BLAS dot/axpy (float64), repeated once if needed.

        The second pass runs only when the first removed more than half of
        the norm squared (the Daniel-Gragg-Kaufman-Stewart criterion with
        ``1/sqrt(2)``): otherwise the first pass already left ``w`` orthogonal
        to working precision ("twice is enough", Parlett).
        """
        w = w.contiguous()
        wf = w.view(-1)
        for _ in range(2):
            before = float(wf.norm())
            for q in basis:
                wf.add_(q.view(-1), alpha=-float(torch.dot(q.view(-1), wf)))
            if not basis or float(wf.norm()) > before / math.sqrt(2):
                break
        return w

    def _extend(self, w: torch.Tensor, basis: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
        """Re-orthogonalise and normalise a new Krylov vector (float64).

        Symmetric products return exactly symmetric matrices (see
        :func:`fisherkron.core.operators._sym_gemm_nt`) and linear combinations of
        them stay exactly symmetric, so no symmetrisation is needed here. These
        are memory-bound vector operations; on the CPU small ones run on one
        thread (see :func:`fisherkron.core.operators._single_thread`).
        """
        with _single_thread(w.device, w.numel()):
            w = self._orth(w, basis)
            nrm = float(w.norm())
            if nrm > 0:
                w.div_(nrm)
        return w, nrm

    def step(self) -> None:
        """One product: a matvec if ``len(U) < len(V)``, else an rmatvec."""
        if len(self.U) < len(self.V):
            if self.identity and not self.U:  # R(I / sqrt(n)) = mean G_i^T G_i / sqrt(n)
                w = self.op.apply(None, True).mul_(float(self.V[0][0, 0]))
            else:
                w = self.op.apply(self.V[-1], self.symmetric)
            w, a = self._extend(w, self.U)  # (m, m)
            self.alpha.append(a)
            self.U.append(w)
        else:
            w, b = self._extend(self.op.apply_adjoint(self.U[-1], self.symmetric), self.V)  # (n, n)
            self.beta.append(b)
            if b <= 1e-14 * max(self.alpha):  # invariant subspace found: Ritz values are exact
                self.breakdown = True
            self.V.append(w)

    def projected(self) -> torch.Tensor:
        """``U^T R V`` (``j x j`` or ``j x (j+1)``), float64 on the CPU."""
        j, c = len(self.U), len(self.V)
        M = torch.zeros(j, c, dtype=torch.float64)
        for i, a in enumerate(self.alpha):
            M[i, i] = a
        for i, b in enumerate(self.beta[:j]):
            if i + 1 < c:
                M[i, i + 1] = b
        return M

    def ritz(self, r: int):
        """Top-``r`` Ritz values and coefficient vectors, plus residual bounds."""
        M = self.projected()
        X, s, Yt = torch.linalg.svd(M, full_matrices=False)
        r = min(r, s.numel())
        X, s, Y = X[:, :r], s[:r], Yt[:r].T
        # Residual bound of the Ritz triplets of the square part B_j = M[:, :j]:
        # R^T U_j = V_j B_j^T + beta_j v_{j+1} e_j^T, so ||R^T u - s v|| = beta_j |x_j|.
        if len(self.V) > len(self.U) and self.beta:
            Xs, ss, _ = torch.linalg.svd(M[:, : len(self.U)], full_matrices=False)
            res = self.beta[-1] * Xs[-1, :r].abs()
        else:
            res = torch.full((r,), float("nan"), dtype=torch.float64)
        return s, X, Y, res

    def matrices(self, X: torch.Tensor, Y: torch.Tensor, i: int):
        """Ritz matrices ``sum_j X[j, i] U_j`` (``m x m``) and ``sum_j Y[j, i] V_j`` (``n x n``)."""
        with _single_thread(self.U[0].device, self.V[0].numel()):
            a = torch.zeros_like(self.U[0])
            for j, u in enumerate(self.U):
                a.add_(u, alpha=float(X[j, i]))
            b = torch.zeros_like(self.V[0])
            for j, v in enumerate(self.V[:Y.shape[0]]):
                b.add_(v, alpha=float(Y[j, i]))
        return a, b


class _Swapped:
    """``R(F)^T`` seen as the operator: lets Golub-Kahan start on the input (``A``) side."""

    def __init__(self, op: RearrangedFisher):
        self.op = op

    def apply(self, Y, symmetric: bool = False):
        return self.op.apply_adjoint(Y, symmetric)

    def apply_adjoint(self, Z, symmetric: bool = False):
        return self.op.apply(Z, symmetric)


def _error_estimate(history: list[float], safety: float = 2.0, q_max: float = 0.95) -> float:
    """Estimated relative error of the latest ``A (x) B`` from the changes ``c_1, c_2, ...`` so far.

    Once Lanczos converges the changes decay about geometrically, ``c_{j+1} ~ q c_j``,
    so the remaining error is ``sum_{l>j} c_l ~ c_j q / (1 - q)``; ``safety`` times that
    is returned. The first change is not used for ``q`` (it still reflects the start,
    and a ratio taken there under-estimated the error on real MiniLM layers), so the
    estimate exists from the third change on; before that it is ``inf``.
    """
    if len(history) < 3:
        return float("inf")
    c, c_prev = history[-1], history[-2]
    if c_prev <= 0:
        return 0.0
    q = min(c / c_prev, q_max)
    return safety * c * q / (1.0 - q)


def _kron_change(s_new, x_new, y_new, s_old, x_old, y_old) -> float:
    """``||s_n a_n (x) b_n - s_o a_o (x) b_o||_F / s_n`` in basis coordinates.

    With orthonormal bases, ``a = U x`` and ``b = V y``, the difference is the
    small matrix ``s_n x_n y_n^T - s_o x_o y_o^T`` (zero-padded), whose norm is
    taken directly: no cancellation, unlike ``s_n^2 + s_o^2 - 2 s_n s_o <.,.>``.
    """
    xo = torch.zeros_like(x_new)
    xo[: x_old.numel()] = x_old
    yo = torch.zeros_like(y_new)
    yo[: y_old.numel()] = y_old
    D = s_new * torch.outer(x_new, y_new) - s_old * torch.outer(xo, yo)
    D2 = s_new * torch.outer(x_new, y_new) + s_old * torch.outer(xo, yo)  # singular vectors have a sign
    return float(min(D.norm(), D2.norm())) / s_new


def _operator(grads, dtype: torch.dtype, device, memory_budget, name: str, group):
    r"""``(op, stack)``: the matrix-free :math:`\mathcal{R}(F)` MFF iterates with, and what holds the gradients
    (a :class:`TokenFisher` is both; per-batch gradients are a :class:`GradientStack`, this rank's share of them
    over a process group)."""
    if isinstance(grads, TokenFisher):  # per-token gradients, matrix-free from X and D
        if group is not None:
            raise FisherkronError(f"{name}: MFF over a process group takes per-batch gradients, not a TokenFisher")
        same = grads.dtype == dtype and (device is None or torch.device(device) == grads.device)
        op = grads if same else TokenFisher(grads.X, grads.D, dtype, device or grads.device, name)
        return op, op
    if group is None:
        stack = GradientStack.of(grads, dtype, device=device, memory_budget=memory_budget, name=name)
        return RearrangedFisher(stack), stack
    stack, k_total = _local_stack(grads, group, dtype, device, memory_budget, name)
    return RearrangedFisher(stack, group=group, k=k_total), stack


def _start(init, n: int, m: int, device, symmetric: bool, identity: bool, swapped: bool):
    """``(Z0, how)``: the float64 start of the Golub-Kahan iteration and its name in :class:`MFFResult`: the
    identity on the output side (``n x n``), or on the input side (``m x m``) where ``swapped``; the symmetric part
    of ``init``; a seeded random ``n x n`` matrix for several terms."""
    if identity:
        Z0 = torch.eye(m if swapped else n, device=device, dtype=torch.float64)
        start = "identity (A side)" if swapped else "identity (B side)"
    elif symmetric:
        Z0 = _sym(_start_matrix(init, n, device))
        start = "init"
    else:
        gen = torch.Generator().manual_seed(0)
        Z0 = torch.randn(n, n, generator=gen, dtype=torch.float64).to(device)
        start = "random"
    if Z0.norm() == 0:
        raise FisherkronError("init (the output-side factor B) has a zero symmetric part")
    return Z0, start


def _terms(gk: "_GolubKahan", s: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, terms: int, swapped: bool):
    r"""``(terms_A, terms_B)``: the Kronecker terms :math:`\sqrt{\sigma_i}\,A_i,\ \sqrt{\sigma_i}\,B_i` from the
    Ritz vectors ``X``, ``Y`` (float64), the first signed so that both its factors are PSD."""
    terms_A, terms_B = [], []
    for i in range(terms):
        a, b = gk.matrices(X, Y, i)  # float64: the Lanczos bases are
        if swapped:  # the Lanczos "U" side was B (n x n), the "V" side A (m x m)
            a, b = b, a
        # symmetric runs need no symmetrisation: the bases are exactly symmetric (see _extend)
        if i == 0 and torch.trace(a) < 0:  # fix the sign so both factors are PSD
            a, b = -a, -b
        scale = math.sqrt(float(s[i]))
        terms_A.append(scale * a)
        terms_B.append(scale * b)
    return terms_A, terms_B


@timed("MFF")
def mff(grads, *, init=None, tol: float | None = None, terms: int = 1, max_matvecs: int = 300,
        dtype: torch.dtype | str = torch.float32, device=None, memory_budget: int | None = None,
        compute_norm: bool = True, name: str = "layer", group=None) -> MFFResult:
    r"""Algorithm 1 (MFF): ``F ~= A (x) B`` from the leading singular triplet of ``R(F)``.

    ``R(F) vec(B) ~= sigma vec(A)``; ``A = sqrt(sigma) mat(u_1)``,
    ``B = sqrt(sigma) mat(v_1)``; both symmetric, signed so that their traces
    are positive (they are then PSD up to round-off for PSD ``F``).

    Args:
        grads: ``k`` per-batch gradients of an ``n x m`` layer: a real ``(k, n, m)``
            tensor, a ``.npy`` path (float32/64, or a 16-bit ``<layer>.grads.npy`` of a calibration
            entry, decoded as its manifest says; see :mod:`fisherkron.core.stored`), a
            :class:`GradientStack` or :class:`~fisherkron.core.stored.StoredGradients`, or an iterable of
            ``(n, m)`` tensors (streamed; spilled to disk past ``memory_budget``); or a
            :class:`~fisherkron.core.operators.TokenFisher` (per-token gradients
            ``delta_t x_t^T``, matrix-free from the layer's inputs and output gradients).
        init: warm start: K-FAC factors ``(A, B)`` (see :func:`kfac_factors`),
            a previous :class:`MFFResult`, or an ``n x n`` matrix ``B``.
            Default (or ``"identity"``): the identity on the cheaper side,
            ``I_n`` when ``m <= n`` (first product ``mean G_i^T G_i``) else ``I_m``
            (first product ``mean G_i G_i^T``); for ``terms > 1`` a seeded random start.
        tol: target relative error of ``A (x) B``: stop when the estimated
            error (from the decay of the changes between Ritz estimates, see
            the module docstring) is below ``tol``, or when a change is below
            ``tol / 10`` (``terms > 1``: when the residual bounds of the top
            ``terms`` triplets are below ``tol``). Default 1e-5 (float32) or
            1e-10 (float64).
        terms: number of Kronecker terms (singular triplets) to return.
        max_matvecs: budget of products with ``R(F)`` or ``R(F)^T``.
        dtype: compute dtype of the GEMMs (float32 default; float64 for references and exact rank
            allocations), a torch dtype or a name of :data:`MFF_DTYPES`.
        device: device of the GEMMs (default: that of ``grads``).
        memory_budget: bytes the gradients and work buffers may use.
        compute_norm: compute ``||F||_F^2`` (one extra pass over the gradients; with a
            ``group`` every gradient is also broadcast once, see
            :func:`fisherkron.core.distributed.fisher_norm_sq`).
        name: layer name for error messages.
        group: data-parallel MFF over a ``torch.distributed`` process group, or ``"auto"``
            for the default group when one is initialised with more than one process
            (default ``None``: this process alone). Each rank passes the gradients of its
            own batches (possibly none); ``R(F)`` is their mean over the *global* ``k``.
            Every product is a local sum and one ``all_reduce`` of an ``m x m`` or ``n x n``
            float64 matrix (``comm_bytes`` in the result); the start, every stop decision
            and the final factors come from rank 0, so every rank runs the same collectives
            and returns the same result. See :mod:`fisherkron.core.distributed`.

    Example:
        >>> A0, B0 = torch.eye(2, dtype=torch.float64), torch.diag(torch.tensor([1., 2., 3.], dtype=torch.float64))
        >>> G = torch.stack([torch.randn(3, 2, dtype=torch.float64) for _ in range(50)])
        >>> res = mff(G, dtype=torch.float64)
        >>> res.A.shape, res.B.shape
        (torch.Size([2, 2]), torch.Size([3, 3]))
    """
    check_int(terms, "terms", minimum=1)
    check_int(max_matvecs, "max_matvecs", minimum=1)
    dtype = mff_dtype(dtype)
    if tol is not None:
        check_positive(tol, "tol", below=1.0)
    t0 = time.perf_counter()
    group = resolve_group(group)
    op, stack = _operator(grads, dtype, device, memory_budget, name, group)
    n, m = op.n, op.m
    if terms > min(n, m) ** 2:
        raise FisherkronError(f"terms={terms} exceeds the rank bound min(n, m)^2={min(n, m) ** 2} of R(F)")
    if tol is None:
        tol = 1e-10 if dtype == torch.float64 else 1e-5
    symmetric = terms == 1
    identity = symmetric and (init is None or (isinstance(init, str) and init == "identity"))
    swapped = identity and m > n  # start from I_m on the input side: R^T(I_m) is the cheaper product
    Z0, start = _start(init, n, m, stack.device, symmetric, identity, swapped)
    if group is not None:  # one start for all ranks: rank 0's
        Z0 = broadcast_tensor(Z0, group)
    gk = _GolubKahan(_Swapped(op) if swapped else op, Z0, symmetric, identity=identity)

    history: list[float] = []
    prev = None
    converged = False
    change = float("inf")
    estimate = float("inf")
    res_bound = float("nan")
    min_steps = 2 * terms + 1
    while op.num_matvecs < max_matvecs:
        gk.step()
        s, X, Y, res = gk.ritz(terms)
        action = _GO
        if s.numel() == 0 or s[0] <= 0:
            action = _ZERO if gk.alpha and gk.alpha[0] == 0 else _SKIP
        else:
            if not torch.isnan(res[0]):
                res_bound = float(res[:terms].max() / s[0])
            if prev is not None and terms == 1:
                change = _kron_change(float(s[0]), X[:, 0], Y[:, 0], *prev)
                history.append(change)
                estimate = _error_estimate(history)
                if change < tol / 10:  # tiny change: stop even before the decay rate is known
                    estimate = min(estimate, change)
                if estimate < tol:
                    action = _STOP
            if terms > 1 and s.numel() >= terms and op.num_matvecs >= min_steps and res_bound < tol:
                action = _STOP
            if gk.breakdown:
                action = _STOP
        if group is not None:  # rank 0 decides, so every rank runs the same number of products
            action = broadcast_int(action, group)
        if action == _ZERO:
            raise FisherkronError(f"{name}: R(F) maps the start to zero (all gradients zero?)")
        if action == _SKIP:
            continue
        if action == _STOP:
            converged = True
            break
        prev = (float(s[0]), X[:, 0].clone(), Y[:, 0].clone())
    else:
        log.warning("%s: MFF stopped at max_matvecs=%d with estimated error %.2e (last change %.2e) > tol=%.1e",
                    name, max_matvecs, estimate, change, tol)
    if terms > 1:
        estimate = res_bound
    elif gk.breakdown:
        estimate = 0.0

    s, X, Y, res = gk.ritz(terms)
    if s.numel() < terms:
        raise FisherkronError(f"{name}: only {s.numel()} Kronecker terms found within max_matvecs={max_matvecs}")
    terms_A, terms_B = _terms(gk, s, X, Y, terms, swapped)
    if stack.device.type == "cuda":
        torch.cuda.synchronize(stack.device)
    seconds = time.perf_counter() - t0
    flops = op.nominal_flops
    if group is None:
        fnorm = stack.fisher_norm_sq() if compute_norm else float("nan")
    else:
        fnorm = fisher_norm_sq(stack, group, op.k) if compute_norm else float("nan")
        # every rank returns rank 0's result (the ranks' bases agree only to round-off)
        terms_A = [broadcast_tensor(a, group) for a in terms_A]
        terms_B = [broadcast_tensor(b, group) for b in terms_B]
        s, converged, change, res_bound, history, estimate, fnorm = broadcast_object(
            (s.clone(), converged, change, res_bound, history, estimate, fnorm), group)
    log.debug("%s: MFF %d matvecs, %.2f s, change %.2e", name, op.num_matvecs, seconds, change)
    return MFFResult(A=terms_A[0], B=terms_B[0], sigma=s.clone(), fisher_norm_sq=fnorm,
                     matvecs=op.num_matvecs, converged=converged, rel_change=change,
                     residual=res_bound, seconds=seconds, flops=flops,
                     history=history, product_seconds=op.product_seconds, executed_flops=op.executed_flops,
                     terms_A=terms_A if terms > 1 else [], terms_B=terms_B if terms > 1 else [],
                     error_estimate=estimate, start=start, world_size=world_of(group),
                     comm_bytes=op.comm_bytes, comm_seconds=op.comm_seconds)


def kronecker_terms(grads, r: int, **kwargs) -> MFFResult:
    """The top-``r`` Kronecker terms of ``F`` (the singular values of ``R(F)``; paper Fig. "singular values")."""
    return mff(grads, terms=r, **kwargs)
