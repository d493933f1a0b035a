"""GFWSVD (Theorem 1) and the weighted-SVD family against dense float64 references."""
import pytest
import torch

import fisherkron as fk
from fisherkron.testing import F64_REL, FLOAT64, OPT_SLACK, abs_sum_scale, assert_close_f32, dense_fisher

SHAPES = [(7, 5), (5, 7), (6, 6)]


def _spd(d, g, jitter=0.3):
    X = torch.randn(d, d + 2, generator=g, dtype=torch.float64)
    return X @ X.T / d + jitter * torch.eye(d, dtype=torch.float64)


def _werr(W, Wr, LA, LB):
    """||L_B^T (W - Wr) L_A||_F^2 (Eq. (14))."""
    return float((LB.T @ (W - Wr) @ LA).norm() ** 2)


def _problem(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    return g, W, _spd(m, g), _spd(n, g)


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("r", [1, 2, 4])
def test_theorem1_error_equals_discarded_singular_values(n, m, r):
    g, W, A, B = _problem(n, m, 10 * n + m + r)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    W2, W1 = fk.gfwsvd(W, A, B, r, min_alpha=0)
    assert W2.shape == (n, r) and W1.shape == (r, m)
    S = torch.linalg.svdvals(LB.T @ W @ LA)
    want = float((S[r:] ** 2).sum())
    assert abs(_werr(W, W2 @ W1, LA, LB) - want) <= F64_REL * max(want, 1.0)
    # the same number through the Kronecker form: vec(dW)^T (A (x) B) vec(dW)
    dW = fk.vec(W - W2 @ W1)
    assert abs(float(dW @ torch.kron(A, B) @ dW) - want) <= F64_REL * max(want, 1.0)
    assert abs(fk.fisher_weighted_error(W, W2 @ W1, A, B) - want) <= F64_REL * max(want, 1.0)


@pytest.mark.parametrize("n,m", SHAPES)
def test_theorem1_no_other_rank_r_matrix_does_better(n, m):
    r = 2
    g, W, A, B = _problem(n, m, 99 + n)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    W2, W1 = fk.gfwsvd(W, A, B, r, min_alpha=0)
    best = _werr(W, W2 @ W1, LA, LB)
    rivals = {}
    S2, S1 = fk.svd(W, r)
    rivals["svd"] = S2 @ S1
    # the two FWSVD forms with the diagonals of A and B as their weights (diag_fisher with those sums)
    F2, F1 = fk.fwsvd(W, torch.diagonal(A)[None, :].expand(n, m) / n, r)
    rivals["fwsvd"] = F2 @ F1
    F2, F1 = fk.fwsvd_rows(W, torch.diagonal(B)[:, None].expand(n, m) / m, r)
    rivals["fwsvd_rows"] = F2 @ F1
    # the transposed Cholesky product of a public reimplementation: L_B W L_A^T
    U, S, Vh = torch.linalg.svd(LB @ W @ LA.T)
    Wt = (U[:, :r] * S[:r]) @ Vh[:r]
    rivals["transposed L_B W L_A^T"] = torch.linalg.solve(LB, torch.linalg.solve(LA, Wt.T).T)
    if n == m:  # literally L_A W L_B (only defined for square layers)
        U, S, Vh = torch.linalg.svd(LA @ W @ LB)
        Wt = (U[:, :r] * S[:r]) @ Vh[:r]
        rivals["L_A W L_B"] = torch.linalg.solve(LA, torch.linalg.solve(LB.T, Wt.T).T)
    for name, Wr in rivals.items():
        assert torch.linalg.matrix_rank(Wr) <= r
        assert _werr(W, Wr, LA, LB) >= best * (1 - OPT_SLACK), name
    strictly = 1e-6  # generic weights: a rival loses by far more than round-off (OPT_SLACK)
    worse = [name for name, Wr in rivals.items() if _werr(W, Wr, LA, LB) > best * (1 + strictly)]
    assert worse == list(rivals)  # generic weights: every rival is strictly worse
    for eps in (1e-1, 1e-3, 1e-6):  # random rank-r perturbations of the optimum
        for _ in range(20):
            P2 = W2 + eps * torch.randn(W2.shape, generator=g, dtype=torch.float64)
            P1 = W1 + eps * torch.randn(W1.shape, generator=g, dtype=torch.float64)
            assert _werr(W, P2 @ P1, LA, LB) >= best * (1 - OPT_SLACK)


@pytest.mark.parametrize("n,m", SHAPES)
def test_fwsvd_rows_is_gfwsvd_with_identity_and_diagonal(n, m):
    """Appendix E: the best I_m (x) D~ fit has d = diag(E[G G^T]) / m; GFWSVD with it is App. E's FWSVD (rows)."""
    g = torch.Generator().manual_seed(5 + n)
    G = torch.randn(12, n, m, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    F = dense_fisher(G)
    # least squares for d over the span of I_m (x) e_i e_i^T, solved densely
    basis = torch.stack([fk.vec(torch.kron(torch.eye(m, dtype=torch.float64),
                                           torch.diag(torch.eye(n, dtype=torch.float64)[i])))
                         for i in range(n)], dim=1)  # ((nm)^2, n)
    d = torch.linalg.lstsq(basis, fk.vec(F)[:, None]).solution[:, 0]
    fisher_rows = (G ** 2).mean(0).sum(1)  # sum_j E[G_ij^2]
    torch.testing.assert_close(d, fisher_rows / m, **FLOAT64)
    for r in (1, 3):
        F2, F1 = fk.fwsvd_rows(W, (G ** 2).mean(0), r)
        G2, G1 = fk.gfwsvd(W, torch.eye(m, dtype=torch.float64), torch.diag(d), r)
        torch.testing.assert_close(F2 @ F1, G2 @ G1, **FLOAT64)
        # and it minimises ||D (W - Wr)||_F with D = diag(sqrt(fisher_rows))
        D = fisher_rows.sqrt()[:, None]
        S = torch.linalg.svdvals(D * W)
        want = float((S[r:] ** 2).sum())
        assert abs(float((D * (W - F2 @ F1)).norm() ** 2) - want) <= F64_REL * max(want, 1.0)
    # it reads the diagonal Fisher only through its row sums
    same_rows = fisher_rows[:, None].expand(n, m) / m
    torch.testing.assert_close(fk.fwsvd_rows(W, (G ** 2).mean(0), 2)[0], fk.fwsvd_rows(W, same_rows, 2)[0], **FLOAT64)


@pytest.mark.parametrize("n,m", SHAPES)
def test_asvd_and_svd_llm_objectives(n, m):
    g = torch.Generator().manual_seed(21 + m)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    X = torch.randn(m, 40, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, m, dtype=torch.float64)[:, None]
    r = 2
    # SVD-LLM minimises ||(W - Wr) X||_F over rank r: error = discarded singular values of W S
    L2, L1 = fk.svd_llm(W, X @ X.T, r, min_alpha=0)
    S = torch.linalg.svdvals(W @ torch.linalg.cholesky(X @ X.T))
    want = float((S[r:] ** 2).sum())
    assert abs(float(((W - L2 @ L1) @ X).norm() ** 2) - want) <= F64_REL * max(want, 1.0)
    S2, S1 = fk.svd(W, r)
    assert float(((W - L2 @ L1) @ X).norm()) <= float(((W - S2 @ S1) @ X).norm()) * (1 + OPT_SLACK)
    # ASVD: SVD of W diag(s^alpha), then undo the scaling
    s = X.abs().mean(1)
    A2, A1 = fk.asvd(W, s, r, alpha=0.5)
    U, Sv, Vh = torch.linalg.svd(W * s.sqrt()[None, :])
    torch.testing.assert_close(A2 @ A1, ((U[:, :r] * Sv[:r]) @ Vh[:r]) / s.sqrt()[None, :], **FLOAT64)


def test_svd_full_rank_exact_and_dtype_kept():
    W = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    W2, W1 = fk.svd(W, 5)
    assert W2.dtype == torch.float32
    # float64 SVD, factors rounded to float32, then a float32 product of r = 5 terms
    assert_close_f32(W2 @ W1, W, length=5, scale=abs_sum_scale(W2.T, W1), what="full-rank W2 W1")


def test_weighted_svd_general_weights_equal_gfwsvd():
    g, W, A, B = _problem(7, 5, 3)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    torch.testing.assert_close(torch.matmul(*fk.weighted_svd(W, 3, left=LB, right=LA)),
                               torch.matmul(*fk.gfwsvd(W, A, B, 3, min_alpha=0)), **FLOAT64)


@pytest.mark.parametrize("call,msg", [
    (lambda W, A, B: fk.gfwsvd(W, A, B, 0), "rank 0 is outside 1..min"),
    (lambda W, A, B: fk.gfwsvd(W, A, B, 6), "rank 6 is outside 1..min\\(n, m\\)=5"),
    (lambda W, A, B: fk.gfwsvd(W, B, A, 2), "A \\(input side, m x m\\) must be 5 x 5"),
    (lambda W, A, B: fk.gfwsvd(W.T, A, B, 2), "must be 7 x 7"),
    (lambda W, A, B: fk.gfwsvd(W[0], A, B, 2), "must be a 2-D matrix"),
    (lambda W, A, B: fk.gfwsvd(torch.full_like(W, float("nan")), A, B, 2), "NaN/inf"),
    (lambda W, A, B: fk.gfwsvd(W, A * float("inf"), B, 2), "NaN/inf"),
    (lambda W, A, B: fk.svd(W, 2.5), "rank must be an integer"),
    (lambda W, A, B: fk.fwsvd(W, -torch.ones(7, 5), 2), "non-negative"),
    (lambda W, A, B: fk.fwsvd_rows(W, -torch.ones(7, 5), 2), "non-negative"),
    (lambda W, A, B: fk.fwsvd(W, torch.ones(7), 2), "the \\(n, m\\) diagonal Fisher"),
    (lambda W, A, B: fk.fwsvd(W, torch.ones(5, 7), 2), "expected \\(7, 5\\)"),
    (lambda W, A, B: fk.asvd(W, torch.ones(4), 2), "expected 5"),
])
def test_bad_input_one_line_errors(call, msg):
    g, W, A, B = _problem(7, 5, 0)
    with pytest.raises(fk.FisherkronError, match=msg) as e:
        call(W, A, B)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n,m", SHAPES)
def test_kfac_svd_is_theorem1_with_the_kfac_factors(n, m):
    """KFAC-SVD against a dense float64 reference: the K-FAC Kronecker product formed explicitly."""
    g = torch.Generator().manual_seed(7 * n + m)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    x = torch.randn(3, 40, m, generator=g, dtype=torch.float64) @ torch.randn(m, m, generator=g, dtype=torch.float64)
    d = torch.randn(3, 40, n, generator=g, dtype=torch.float64)
    kf = fk.kfac_factors(x, d)
    r = 2
    W2, W1 = f = fk.factorize_weight("kfac_svd", W, r, kfac=kf, min_alpha=0)
    assert f.alpha_A == 0 and f.alpha_B == 0
    # the error in the K-FAC metric, through the dense (nm x nm) Kronecker product, is the discarded tail
    F = torch.kron(kf.A, kf.B)
    dW = fk.vec(W - W2 @ W1)
    LA, LB = torch.linalg.cholesky(kf.A), torch.linalg.cholesky(kf.B)
    tail = float((torch.linalg.svdvals(LB.T @ W @ LA)[r:] ** 2).sum())
    assert abs(float(dW @ F @ dW) - tail) <= F64_REL * tail
    # and no other method does better in that metric
    for rival in ("svd", "fwsvd", "fwsvd_rows"):
        R2, R1 = fk.factorize_weight(rival, W, r, diag_fisher=torch.ones(n, m, dtype=torch.float64))
        dR = fk.vec(W - R2 @ R1)
        assert float(dR @ F @ dR) >= tail * (1 - OPT_SLACK)
    with pytest.raises(fk.FisherkronError, match="needs the K-FAC factors"):
        fk.factorize_weight("kfac_svd", W, r)
