"""MFF (Algorithm 1) against the dense SVD of the materialised rearranged Fisher."""
import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.testing import (F64_REL, FLOAT64, MFF_F32_REL, MFF_F64_REL, MFF_REF_TOL, PSD_SLACK, dense_fisher,
                                dense_rearrangement, kronecker_gradients, rel_error)


def _dense_top(G, r=1):
    k, n, m = G.shape
    R = dense_rearrangement(dense_fisher(G), n, m)
    U, S, Vh = torch.linalg.svd(R)
    return U[:, :r], S[:r], Vh[:r], R


def _kron_of(res):
    return torch.outer(fk.vec(res.A), fk.vec(res.B))  # R(A (x) B) = vec(A) vec(B)^T


@pytest.mark.parametrize("seed,n,m,k", [(0, 7, 5, 6), (1, 5, 7, 9), (2, 4, 4, 3), (3, 9, 3, 20), (4, 3, 8, 2),
                                        (5, 6, 2, 40)])
def test_mff_equals_dense_top_singular_triplet(seed, n, m, k):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(k, n, m, generator=g, dtype=torch.float64)
    U, S, Vh, _ = _dense_top(G)
    ref = S[0] * torch.outer(U[:, 0], Vh[0])
    res = fk.mff(G, dtype=torch.float64)
    assert res.converged
    assert rel_error(_kron_of(res), ref) <= MFF_F64_REL
    assert abs(float(res.sigma[0]) - float(S[0])) <= MFF_F64_REL * float(S[0])
    # diagnostics: share of the Fisher captured, against the dense F
    share = float(S[0] ** 2 / dense_fisher(G).norm() ** 2)
    assert abs(res.fisher_share - share) <= F64_REL
    assert res.matvecs >= 2


@pytest.mark.parametrize("seed,n,m,k", [(0, 7, 5, 6), (1, 5, 7, 9), (2, 3, 8, 30)])
def test_factors_symmetric_psd(seed, n, m, k):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(k, n, m, generator=g, dtype=torch.float64)
    res = fk.mff(G, dtype=torch.float64)
    for X in (res.A, res.B):
        torch.testing.assert_close(X, X.T, **FLOAT64)
        ev = torch.linalg.eigvalsh(X)
        assert ev.min() >= -PSD_SLACK * ev.max()
    assert res.A.shape == (m, m) and res.B.shape == (n, n)


@pytest.mark.parametrize("n,m", [(5, 3), (3, 5)])
def test_exact_kronecker_fisher_is_recovered(n, m):
    g = torch.Generator().manual_seed(7)
    XA = torch.randn(m, m, generator=g, dtype=torch.float64)
    XB = torch.randn(n, n, generator=g, dtype=torch.float64)
    A0 = XA @ XA.T + 0.5 * torch.eye(m, dtype=torch.float64)
    B0 = XB @ XB.T + 0.5 * torch.eye(n, dtype=torch.float64)
    G = kronecker_gradients(A0, B0)
    torch.testing.assert_close(dense_fisher(G), torch.kron(A0, B0), **FLOAT64)  # the construction is exact
    res = fk.mff(G, dtype=torch.float64)
    torch.testing.assert_close(torch.kron(res.A, res.B), torch.kron(A0, B0), **FLOAT64)
    assert abs(res.fisher_share - 1.0) <= F64_REL


def test_streamed_input_equals_stacked(tmp_path):
    g = torch.Generator().manual_seed(11)
    G = torch.randn(10, 7, 5, generator=g, dtype=torch.float64)
    ref = fk.mff(G, dtype=torch.float64)
    path = tmp_path / "g.npy"
    np.save(path, G.numpy())
    small = 7 * 5 * 8 * 3 * 2  # two gradients per chunk
    for src in ((Gi for Gi in G), list(G), str(path)):
        res = fk.mff(src, dtype=torch.float64, memory_budget=small)
        torch.testing.assert_close(torch.kron(res.A, res.B), torch.kron(ref.A, ref.B), **FLOAT64)


def test_slices_of_a_memory_mapped_file_are_their_own_gradients(tmp_path):
    """A slice of np.load(mmap_mode="r") keeps the file's offset attribute: the rows read must be the slice's."""
    G = torch.randn(6, 7, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    np.save(tmp_path / "g.npy", G.numpy())
    mm = np.load(tmp_path / "g.npy", mmap_mode="r")
    for rows in (slice(2, 5), slice(1, 6, 2), slice(5, 6)):  # contiguous, strided, one gradient (contiguous)
        res = fk.mff(mm[rows], dtype=torch.float64)
        ref = fk.mff(G[rows], dtype=torch.float64)
        torch.testing.assert_close(torch.kron(res.A, res.B), torch.kron(ref.A, ref.B), **FLOAT64)


def test_float32_default_close_to_float64():
    g = torch.Generator().manual_seed(12)
    G = torch.randn(16, 24, 12, generator=g, dtype=torch.float64)
    r64 = fk.mff(G, dtype=torch.float64)
    r32 = fk.mff(G.float())
    assert r32.A.dtype == torch.float64  # returned in float64 whatever the compute dtype
    assert rel_error(_kron_of(r32), _kron_of(r64)) <= MFF_F32_REL


@pytest.mark.parametrize("n,m,k,r", [(7, 5, 6, 4), (5, 7, 9, 3), (4, 4, 5, 6)])
def test_terms_match_dense_top_singular_values(n, m, k, r):
    g = torch.Generator().manual_seed(n + m + k)
    G = torch.randn(k, n, m, generator=g, dtype=torch.float64)
    _, S, _, _ = _dense_top(G, r)
    res = fk.kronecker_terms(G, r, dtype=torch.float64, tol=MFF_REF_TOL)
    assert float((res.sigma - S).abs().max()) <= MFF_F64_REL * float(S[0])  # Lanczos: accurate relative to sigma_1
    assert len(res.terms_A) == r and res.terms_A[1].shape == (m, m)


def test_kfac_warm_start_is_more_accurate_per_matvec():
    """G_i = sum_t delta_t x_t^T with correlated x, delta: K-FAC starts closer to the answer."""
    g = torch.Generator().manual_seed(13)
    n, m, k, T = 12, 8, 100, 16
    Cx = torch.randn(m, m, generator=g, dtype=torch.float64)
    Cd = torch.randn(n, n, generator=g, dtype=torch.float64)
    x = torch.randn(k, T, m, generator=g, dtype=torch.float64) @ Cx.T  # (k, T, m)
    d = torch.randn(k, T, n, generator=g, dtype=torch.float64) @ Cd.T  # (k, T, n)
    G = torch.einsum("ktn,ktm->knm", d, x)  # (k, n, m)
    ref = _kron_of(fk.mff(G, dtype=torch.float64, tol=MFF_REF_TOL))
    kfac = fk.kfac_factors(x, d, num_batches=k)
    for budget in (2, 4):
        cold = fk.mff(G, dtype=torch.float64, max_matvecs=budget)
        warm = fk.mff(G, dtype=torch.float64, max_matvecs=budget, init=kfac)
        assert warm.matvecs == cold.matvecs == budget
        assert rel_error(_kron_of(warm), ref) < 0.5 * rel_error(_kron_of(cold), ref)
    again = fk.mff(G, dtype=torch.float64, tol=1e-8, init=fk.mff(G, dtype=torch.float64, tol=1e-10))
    assert again.matvecs <= 3  # a previous solution is a start too


def test_tolerance_controls_accuracy():
    g = torch.Generator().manual_seed(14)
    G = torch.randn(8, 9, 7, generator=g, dtype=torch.float64)
    U, S, Vh, _ = _dense_top(G)
    ref = S[0] * torch.outer(U[:, 0], Vh[0])
    loose_tol, tight_tol = 1e-3, 1e-10  # the two stopping targets compared
    loose = fk.mff(G, dtype=torch.float64, tol=loose_tol)
    tight = fk.mff(G, dtype=torch.float64, tol=tight_tol)
    assert loose.matvecs < tight.matvecs
    assert rel_error(_kron_of(tight), ref) < rel_error(_kron_of(loose), ref)
    assert loose.rel_change < loose_tol


@pytest.mark.parametrize("n,m,side", [(7, 5, "B"), (5, 7, "A"), (6, 6, "B")])
def test_identity_start_on_the_cheaper_side(n, m, side):
    """Default start: I on the side whose first product is one symmetric GEMM; same answer as dense."""
    g = torch.Generator().manual_seed(n * 10 + m)
    G = torch.randn(9, n, m, generator=g, dtype=torch.float64)
    U, S, Vh, _ = _dense_top(G)
    ref = S[0] * torch.outer(U[:, 0], Vh[0])
    res = fk.mff(G, dtype=torch.float64)
    assert res.start == f"identity ({side} side)"
    assert res.A.shape == (m, m) and res.B.shape == (n, n)
    assert rel_error(_kron_of(res), ref) <= MFF_F64_REL
    explicit = fk.mff(G, dtype=torch.float64, init="identity")
    torch.testing.assert_close(explicit.A, res.A, **FLOAT64)
    # the same start given as a matrix runs the plain products: same Krylov space when side is B
    if side == "B":
        as_matrix = fk.mff(G, dtype=torch.float64, init=torch.eye(n, dtype=torch.float64))
        assert as_matrix.start == "init" and as_matrix.matvecs == res.matvecs
        assert as_matrix.executed_flops > res.executed_flops  # the first product was a full one
        torch.testing.assert_close(torch.kron(as_matrix.A, as_matrix.B), torch.kron(res.A, res.B), **FLOAT64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tol", [1e-3, 1e-5, 1e-7])
def test_error_estimate_stop_meets_the_tolerance(seed, tol):
    """tol is a target error of A (x) B: the measured error against the dense answer stays below it."""
    from fisherkron.experiments.synthetic_gradients import synthetic_gradients
    G = synthetic_gradients(9, 6, 12, tokens=8, rho=0.5, seed=seed, dtype=torch.float64).G
    U, S, Vh, _ = _dense_top(G)
    ref = S[0] * torch.outer(U[:, 0], Vh[0])
    res = fk.mff(G, dtype=torch.float64, tol=tol)
    assert res.converged and res.error_estimate < tol
    assert rel_error(_kron_of(res), ref) <= tol


def test_noise_floor_stops_at_once():
    """Exactly Kronecker gradients in float32: the first change is at round-off, no budget is burnt."""
    g = torch.Generator().manual_seed(21)
    XA = torch.randn(4, 4, generator=g, dtype=torch.float64)
    XB = torch.randn(6, 6, generator=g, dtype=torch.float64)
    G = kronecker_gradients(XA @ XA.T + torch.eye(4, dtype=torch.float64),
                            XB @ XB.T + torch.eye(6, dtype=torch.float64)).float()
    res = fk.mff(G, tol=1e-5, init=torch.eye(6))
    assert res.converged and res.matvecs <= 4


def test_bad_arguments():
    G = torch.randn(3, 4, 2)
    with pytest.raises(fk.FisherkronError, match="terms must be"):
        fk.mff(G, terms=0)
    with pytest.raises(fk.FisherkronError, match="init"):
        fk.mff(G, init=torch.zeros(4, 4))
    with pytest.raises(fk.FisherkronError, match="must be 4 x 4"):
        fk.mff(G, init=torch.eye(3))
    with pytest.raises(fk.FisherkronError, match="init='kfac'"):
        fk.mff(G, init="kfac")
    with pytest.raises(fk.FisherkronError, match="batch 1"):
        fk.mff(torch.stack([torch.randn(4, 2), torch.full((4, 2), float("inf"))]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("budget", [None, 7 * 4 * 8 * 3])
def test_inputs_are_never_modified(dtype, budget):
    for src_dtype in (torch.float32, torch.float64):
        G = torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(0), dtype=src_dtype)
        G0 = G.clone()
        fk.mff(G, dtype=dtype, memory_budget=budget)
        fk.mff(G.numpy(), dtype=dtype, memory_budget=budget)
        fk.mff(list(G), dtype=dtype, memory_budget=budget)
        assert torch.equal(G, G0)


def test_mff_takes_its_dtype_by_name():
    """A notebook or YAML gives MFF's dtype as a name; the result equals the torch dtype's, an unknown name fails."""
    G = torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    a, b = fk.mff(G, dtype="float64"), fk.mff(G, dtype=torch.float64)
    assert a.A.dtype == torch.float64 and torch.equal(a.A, b.A) and torch.equal(a.B, b.B)
    with pytest.raises(fk.FisherkronError, match="MFF computes in float32 or float64"):
        fk.mff(G, dtype="float16")
