r"""Matrix-free rearranged Fisher (paper Sec. 4.1, Eq. (12), Appendices B-C).

For per-batch gradients ``G_i`` (``n x m``) the empirical Fisher
``F = (1/k) sum_i vec(G_i) vec(G_i)^T`` is rearranged (Van Loan-Pitsianis)
into ``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` (``m^2 x n^2``; see
:mod:`fisherkron.conventions`). It is applied without ever forming ``F``:

.. math::
    R(F)\,\mathrm{vec}(Z) = \mathrm{vec}\Big(\tfrac1k\sum_i G_i^\top Z G_i\Big),
    \qquad
    R(F)^\top \mathrm{vec}(Y) = \mathrm{vec}\Big(\tfrac1k\sum_i G_i Y G_i^\top\Big).

Each product is two plain GEMMs over the gradients stored in an
``(n, k, m)`` layout (no Python loop over gradients):

* matvec: ``P = Z @ G.view(n, k m)``; ``out = G.view(n k, m)^T @ P.view(n k, m)``
* rmatvec: ``P = G.view(n k, m) @ Y``; ``out = P.view(n, k m) @ G.view(n, k m)^T``

so one application costs ``2 k n m (n + m)`` flops. For symmetric ``Z`` or
``Y`` (what :func:`fisherkron.mff` uses) the result is symmetric and the second
GEMM computes only its lower block triangle (``(b + 1) / (2 b)`` of its flops
for ``b`` row blocks of ~``SYM_BLOCK`` rows), so fewer flops are executed than
the nominal count.

The gradients come from a :class:`~fisherkron.core.gradient_stack.GradientStack`: gradients that do
not fit the memory budget are streamed in chunks of batches, from memory or from a ``.npy`` file
opened memory-mapped.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import scipy.sparse.linalg as spla
import torch

from .conventions import FisherkronError, unvec, vec
from .gradient_stack import GradientStack, default_memory_budget
from .stored import ENCODINGS, StoredGradients, encode_gradient

__all__ = ["RearrangedFisher", "TokenFisher", "rearranged_fisher", "matvec_flops",
           # the gradients' containers, from gradient_stack and stored, importable from here too
           "GradientStack", "default_memory_budget", "StoredGradients", "encode_gradient", "ENCODINGS"]


#: Vectors with at least this many entries are updated with all threads (see :func:`_single_thread`).
THREADED_NUMEL = 1 << 20


@contextmanager
def _single_thread(device: torch.device, numel: int = 0):
    """Run the enclosed CPU tensor operations on one thread when they are small.

    Used for the memory-bound operations around the GEMMs (casts, scaling,
    Lanczos vector updates). Below ``THREADED_NUMEL`` entries one thread is as
    fast as two and free of OpenMP barrier stalls when the cores are shared;
    above it two threads halve the time on an idle machine (dot and axpy on
    3072^2 float64 entries: 9.6 and 11.8 ms on one thread, 4.6 and 4.7 ms on
    two), so ``numel`` at or above it leaves the thread count alone.
    """
    if device.type != "cpu" or torch.get_num_threads() == 1 or numel >= THREADED_NUMEL:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: Target row-block size of :func:`_sym_gemm_nt` (at most ``SYM_MAX_BLOCKS`` blocks); outputs
#: smaller than two blocks use one plain GEMM. Measured on 2 cores: blocks of ~200 rows keep
#: the GEMMs efficient (0.73-0.78 of the full GEMM's time at N = 384-768, 0.65 at N = 1536).
SYM_BLOCK = 192
SYM_MAX_BLOCKS = 6


def _sym_blocks(N: int) -> int:
    return min(SYM_MAX_BLOCKS, N // SYM_BLOCK)


def _sym_gemm_nt(L: torch.Tensor, R: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """``L @ R^T`` (``N x N``) for ``L``, ``R`` of shape ``(N, K)``; symmetric results cost ~half.

    When the product is known to be symmetric, only the blocks on and below
    the diagonal are computed (row block ``I``: ``L[I] @ R[:end(I)]^T``) and
    the rest is filled in by transposition: with ``b`` blocks this does
    ``(b + 1) / (2 b)`` of the flops of the full GEMM. A symmetric result is
    exactly symmetric, so callers never need to symmetrise it again.
    """
    N = L.shape[0]
    nb = _sym_blocks(N)
    if not symmetric:
        return L @ R.T
    if nb < 2:  # small: one GEMM, made exactly symmetric like the blocked result
        out = L @ R.T
        return out.add_(out.T.clone()).mul_(0.5)
    out = torch.empty(N, N, dtype=L.dtype, device=L.device)
    edges = [round(i * N / nb) for i in range(nb + 1)]
    for i in range(nb):
        a, b = edges[i], edges[i + 1]
        torch.matmul(L[a:b], R[:b].T, out=out[a:b, :b])  # (b - a, b): row block I, columns up to its end
    for i in range(nb):
        a, b = edges[i], edges[i + 1]
        D = out[a:b, a:b]
        D.add_(D.T.clone()).mul_(0.5)  # the diagonal block, exactly symmetric
        if i:
            out[:a, a:b] = out[a:b, :a].T  # upper blocks from the lower ones
    return out


def _sym_gemm_fraction(N: int, symmetric: bool) -> float:
    """Share of the flops of an ``N x N`` output GEMM that :func:`_sym_gemm_nt` executes."""
    nb = _sym_blocks(N)
    return (nb + 1) / (2 * nb) if symmetric and nb >= 2 else 1.0


def matvec_flops(n: int, m: int, k: int) -> int:
    """Flops of one application of ``R(F)`` or ``R(F)^T``: ``2 k n m (n + m)``."""
    return 2 * k * n * m * (n + m)


class RearrangedFisher(spla.LinearOperator):
    r"""``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` as a scipy ``LinearOperator`` (``m^2 x n^2``).

    ``matvec(vec(Z)) = vec((1/k) sum_i G_i^T Z G_i)`` (Eq. (12)) and
    ``rmatvec(vec(Y)) = vec((1/k) sum_i G_i Y G_i^T)`` (Eq. (23)), with
    column-major ``vec``. The matrix forms :meth:`apply` and
    :meth:`apply_adjoint` work on torch tensors on the gradients' device and
    are what :func:`fisherkron.mff` uses. ``num_matvecs`` counts applications.

    With a process group (``group``; see :mod:`fisherkron.core.distributed`) ``grads`` are
    this rank's ``k_p`` gradients and ``k`` is the total over the ranks: each product is the
    local sum ``sum_{i in p} G_i^T Z G_i``, one ``all_reduce`` of that ``m x m`` (or ``n x n``)
    float64 matrix, and the division by the global ``k``. ``comm_bytes`` counts the bytes
    all-reduced (``8 (m^2 + 1)`` or ``8 (n^2 + 1)`` per product); flop counts are this rank's.
    """

    def __init__(self, grads: GradientStack, group=None, k: int | None = None):
        self.grads = grads
        self.n, self.m, self.k = grads.n, grads.m, grads.k
        self.k_local = grads.k  # gradients held here: the flops; k: the mean's denominator
        self.group = group
        if k is not None:
            self.k = int(k)
        self.comm_bytes = 0  # bytes all-reduced by the products (process group only)
        self.comm_seconds = 0.0  # wall time inside those all_reduce calls
        self.num_matvecs = 0
        self.product_seconds = 0.0  # wall time inside apply/apply_adjoint (device synchronised)
        self.executed_flops = 0  # flops the GEMMs actually did (fewer than nominal for symmetric inputs)
        self.nominal_flops = 0  # flops of plain GEMMs: 2 k n m (n + m) per product; 2 k n m^2 for R(I), 2 k m n^2 for R^T(I)
        np_dtype = np.float64 if grads.dtype == torch.float64 else np.float32
        super().__init__(dtype=np_dtype, shape=(self.m ** 2, self.n ** 2))

    # -- matrix forms ---------------------------------------------------------
    def _sync(self) -> None:
        if self.grads.device.type == "cuda":
            torch.cuda.synchronize(self.grads.device)

    def _product(self, X: torch.Tensor | None, per_chunk, executed_flops: float,
                 nominal_flops: float | None = None, size: int = 0) -> torch.Tensor:
        """``(1/k) sum_chunks per_chunk(X, G_c)`` accumulated in float64, with timing and flop counts.

        With a process group the local sum goes into a flat buffer with one more entry
        (``size x size`` result + the failure flag) and is summed over the ranks.
        """
        t0 = time.perf_counter()
        dev = self.grads.device
        if X is not None:
            with _single_thread(dev, X.numel()):
                X = X.to(dev, self.grads.dtype)
        if self.group is not None:
            out = self._reduced_product(X, per_chunk, size)
        else:
            out = None
            for Gc in self.grads.chunks():  # (n, kc, m)
                part = per_chunk(X, Gc)
                with _single_thread(dev, part.numel()):
                    out = part.double() if out is None else out.add_(part)
        self.num_matvecs += 1
        self.executed_flops += int(executed_flops)
        self.nominal_flops += int(matvec_flops(self.n, self.m, self.k_local) if nominal_flops is None
                                  else nominal_flops)
        with _single_thread(dev, out.numel()):
            out = out.div_(self.k)
        self._sync()
        self.product_seconds += time.perf_counter() - t0
        return out

    def _reduced_product(self, X, per_chunk, size: int) -> torch.Tensor:
        """This rank's ``sum_chunks per_chunk(X, G_c)`` summed over the ranks (``size x size``, float64).

        A local failure (an unreadable or non-finite gradient) still takes part in the
        ``all_reduce``, with zeros and its flag set; then every rank raises.
        """
        from .distributed import all_reduce_sum, product_comm_bytes

        dev = self.grads.device
        buf = torch.zeros(size * size + 1, dtype=torch.float64, device=dev)  # (size^2 + 1,): result, flag
        out = buf[:-1].view(size, size)
        error = None
        try:
            for Gc in self.grads.chunks():  # (n, kc, m)
                part = per_chunk(X, Gc)
                with _single_thread(dev, part.numel()):
                    out.add_(part)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks through the flag
            error = exc
            out.zero_()
        t0 = time.perf_counter()
        buf, failures = all_reduce_sum(buf, self.group, failed=error is not None)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_bytes += product_comm_bytes(size)
        if failures:
            if error is not None:
                raise error
            raise FisherkronError(f"{self.grads.name}: MFF stopped because {failures} other rank(s) failed "
                                  f"(see their error)")
        return out

    def apply(self, Z: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/k) sum_i G_i^T Z G_i`` for ``Z`` (``n x n``) -> ``m x m`` (float64 accumulation over chunks).

        With ``symmetric=True`` (``Z`` symmetric, so is the result) only the
        lower block triangle of the second GEMM is computed (see :func:`_sym_gemm_nt`).
        ``Z=None`` means ``Z = I_n``: ``(1/k) sum_i G_i^T G_i``, one symmetric GEMM
        (``k n m^2`` flops instead of ``2 k n m (n + m)``).
        """
        n, m = self.n, self.m
        if Z is None:
            def gram(_, Gc):  # sum_i G_i^T G_i: the rows of all G_i stacked, (n kc, m)
                Gs = Gc.view(n * Gc.shape[1], m).T
                return _sym_gemm_nt(Gs, Gs, True)

            return self._product(None, gram, 2 * self.k_local * n * m * m * _sym_gemm_fraction(m, True),
                                 2 * self.k_local * n * m * m, size=m)

        def per_chunk(Z, Gc):  # Gc: (n, kc, m)
            kc = Gc.shape[1]
            P = Z @ Gc.view(n, kc * m)  # (n, kc m): Z G_i side by side
            return _sym_gemm_nt(Gc.view(n * kc, m).T, P.view(n * kc, m).T, symmetric)  # (m, m): sum G_i^T Z G_i

        return self._product(Z, per_chunk, 2 * self.k_local * n * m * (n + m * _sym_gemm_fraction(m, symmetric)),
                             size=m)

    def apply_adjoint(self, Y: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/k) sum_i G_i Y G_i^T`` for ``Y`` (``m x m``) -> ``n x n`` (float64 accumulation over chunks).

        ``symmetric=True``: ``Y`` is symmetric; only the lower block triangle is computed.
        ``Y=None`` means ``Y = I_m``: ``(1/k) sum_i G_i G_i^T``, one symmetric GEMM (``k m n^2`` flops).
        """
        n, m = self.n, self.m
        if Y is None:
            def gram(_, Gc):  # sum_i G_i G_i^T: the columns of all G_i side by side, (n, kc m)
                Gs = Gc.view(n, Gc.shape[1] * m)
                return _sym_gemm_nt(Gs, Gs, True)

            return self._product(None, gram, 2 * self.k_local * n * n * m * _sym_gemm_fraction(n, True),
                                 2 * self.k_local * n * n * m, size=n)

        def per_chunk(Y, Gc):  # Gc: (n, kc, m)
            kc = Gc.shape[1]
            P = Gc.view(n * kc, m) @ Y  # (n kc, m): G_i Y stacked
            return _sym_gemm_nt(P.view(n, kc * m), Gc.view(n, kc * m), symmetric)  # (n, n): sum G_i Y G_i^T

        return self._product(Y, per_chunk, 2 * self.k_local * n * m * (m + n * _sym_gemm_fraction(n, symmetric)),
                             size=n)

    # -- scipy LinearOperator interface ----------------------------------------
    def _matvec(self, x):
        x = np.asarray(x).reshape(-1)
        Z = unvec(torch.from_numpy(np.ascontiguousarray(x)), self.n, self.n)
        return vec(self.apply(Z)).cpu().numpy().astype(self.dtype, copy=False)

    def _rmatvec(self, x):
        x = np.asarray(x).reshape(-1)
        Y = unvec(torch.from_numpy(np.ascontiguousarray(x)), self.m, self.m)
        return vec(self.apply_adjoint(Y)).cpu().numpy().astype(self.dtype, copy=False)

    def _adjoint(self):
        return _Adjoint(self)

    def materialize(self) -> torch.Tensor:
        """Dense ``R(F)`` (float64, ``m^2 x n^2``) from the gradients; for small tests only."""
        G = self.grads.stacked().double()  # (k, n, m)
        return sum(torch.kron(Gi.T.contiguous(), Gi.T.contiguous()) for Gi in G) / self.k


class _Adjoint(spla.LinearOperator):
    def __init__(self, op: RearrangedFisher):
        self.op = op
        super().__init__(dtype=op.dtype, shape=(op.shape[1], op.shape[0]))

    def _matvec(self, x):
        return self.op._rmatvec(x)

    def _rmatvec(self, x):
        return self.op._matvec(x)


def rearranged_fisher(grads, dtype: torch.dtype = torch.float64, device=None,
                      memory_budget: int | None = None) -> RearrangedFisher:
    """The rearranged Fisher ``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` as a ``LinearOperator``.

    Args:
        grads: ``(k, n, m)`` tensor/array, ``.npy`` path, or iterable of ``(n, m)`` gradients.
        dtype: float64 (default, for use with scipy solvers) or float32.

    Example:
        >>> G = torch.randn(4, 3, 2, dtype=torch.float64)   # k=4 gradients of a 3 x 2 layer
        >>> R = rearranged_fisher(G)
        >>> R.shape                                           # (m^2, n^2)
        (4, 9)
        >>> bool(np.allclose(R @ np.ones(9), R.materialize().numpy() @ np.ones(9)))
        True
    """
    return RearrangedFisher(GradientStack.of(grads, dtype, device=device, memory_budget=memory_budget))


class TokenFisher:
    r"""``R(F)`` of the per-token empirical Fisher, matrix-free from a layer's inputs and output gradients.

    Each token's gradient ``G_t = delta_t x_t^T`` (``n x m``) is rank one, so the Fisher of the
    ``T`` token gradients, ``F = (1/T) sum_t vec(G_t) vec(G_t)^T``, rearranges to

    .. math::
        R(F) = \frac1T \sum_t \mathrm{vec}(x_t x_t^\top)\,\mathrm{vec}(\delta_t \delta_t^\top)^\top,

    and its products (Eq. (12) and (23) with ``G_t^T Z G_t = (delta_t^T Z delta_t) x_t x_t^T``) are

    * ``apply(Z) = (1/T) X^T diag(w) X`` with ``w_t = delta_t^T Z delta_t`` (``m x m``),
    * ``apply_adjoint(Y) = (1/T) D^T diag(v) D`` with ``v_t = x_t^T Y x_t`` (``n x n``),

    from ``X`` (``T x m``, the inputs ``x_t``) and ``D`` (``T x n``, the output gradients
    ``delta_t``): about ``2 T (n^2 + m^2)`` flops per product and no gradient matrix stored.
    K-FAC's ``E[x x^T] (x) E[delta delta^T]`` is the product of the two means; MFF on this operator
    is the best Kronecker fit of the mean of the products. :func:`fisherkron.mff` accepts it in
    place of gradients.

    Args:
        X: ``(T, m)`` layer inputs, one row per token.
        D: ``(T, n)`` gradients of the loss with respect to the layer outputs, same tokens.
        dtype: compute dtype of the GEMMs (float32 default, float64 for references).
        device: where they run (default: that of ``X``).
        name: used in error messages.
    """

    def __init__(self, X, D, dtype: torch.dtype = torch.float32, device=None, name: str = "layer"):
        from .checks import as_tensor, check_finite, check_matrix

        X, D = as_tensor(X, f"{name}: X"), as_tensor(D, f"{name}: D")
        check_matrix(X, f"{name}: X (T x m)")
        check_matrix(D, f"{name}: D (T x n)")
        if X.shape[0] != D.shape[0]:
            raise FisherkronError(f"{name}: X has {X.shape[0]} tokens and D {D.shape[0]}; they must be the same tokens")
        if X.shape[0] == 0:
            raise FisherkronError(f"{name}: no tokens were given")
        check_finite(X, f"{name}: X")
        check_finite(D, f"{name}: D")
        self.name = name
        self.device = torch.device(device) if device is not None else X.device
        self.dtype = dtype
        self.X = X.to(self.device, dtype)  # (T, m)
        self.D = D.to(self.device, dtype)  # (T, n)
        self.k, self.m = (int(s) for s in self.X.shape)
        self.n = int(self.D.shape[1])
        self.k_local = self.k
        self.comm_bytes, self.comm_seconds = 0, 0.0
        self.num_matvecs = 0
        self.product_seconds = 0.0
        self.executed_flops = self.nominal_flops = 0

    def _weighted_gram(self, M: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``(1/T) M^T diag(w) M`` (float64) for ``M`` of shape ``(T, d)``."""
        return ((M.T * w[None, :]) @ M).double().div_(self.k)

    def _count(self, t0: float, flops: int) -> None:
        self.num_matvecs += 1
        self.executed_flops += flops
        self.nominal_flops += flops
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.product_seconds += time.perf_counter() - t0

    def _product(self, P: torch.Tensor, Q: torch.Tensor, M: torch.Tensor | None) -> torch.Tensor:
        """``(1/T) sum_t (p_t^T M p_t) q_t q_t^T`` for rows ``p_t`` of ``P`` (``T x a``), ``q_t`` of ``Q``
        (``T x b``); ``M=None`` means ``I_a``. Both products below are this with the sides swapped."""
        t0 = time.perf_counter()
        T, a = P.shape
        if M is None:
            w = (P * P).sum(1)  # (T,): |p_t|^2
            flops = 2 * T * a
        else:
            w = ((P @ M.to(self.device, self.dtype)) * P).sum(1)  # (T,): p_t^T M p_t
            flops = 2 * T * a * a + 2 * T * a
        out = self._weighted_gram(Q, w)
        self._count(t0, flops + 2 * T * Q.shape[1] ** 2)
        return out

    def apply(self, Z: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/T) sum_t (delta_t^T Z delta_t) x_t x_t^T`` (``m x m``); ``Z=None`` means ``I_n``."""
        return self._product(self.D, self.X, Z)

    def apply_adjoint(self, Y: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/T) sum_t (x_t^T Y x_t) delta_t delta_t^T`` (``n x n``); ``Y=None`` means ``I_m``."""
        return self._product(self.X, self.D, Y)

    def fisher_norm_sq(self, block: int = 2048) -> float:
        """``||F||_F^2 = (1/T^2) sum_{t,s} (x_t . x_s)^2 (delta_t . delta_s)^2``, in blocks of ``block`` tokens."""
        total = 0.0
        X, D = self.X.double(), self.D.double()
        for a in range(0, self.k, block):
            gx = X[a:a + block] @ X.T  # (b, T)
            gd = D[a:a + block] @ D.T
            total += float(((gx * gd) ** 2).sum())
        return total / self.k ** 2

    def gradients(self) -> torch.Tensor:
        """The ``T`` token gradients ``G_t = delta_t x_t^T`` as a ``(T, n, m)`` tensor (small tests only)."""
        return self.D[:, :, None] * self.X[:, None, :]

    def materialize(self) -> torch.Tensor:
        """Dense ``R(F)`` (float64, ``m^2 x n^2``); for small tests only."""
        X, D = self.X.double(), self.D.double()
        xx = torch.einsum("ti,tj->tji", X, X).reshape(self.k, -1)  # (T, m^2): vec(x x^T), column-major
        dd = torch.einsum("ti,tj->tji", D, D).reshape(self.k, -1)  # (T, n^2)
        return xx.T @ dd / self.k
