"""The two forms of FWSVD against dense float64 references.

``fwsvd`` weights the input columns by ``d_j = sqrt(sum_i E[G_ij^2])``, as the public FWSVD code
does: ``W ~= SVD_r(W D) D^{-1}``, GFWSVD with ``A = diag(sum_i E[G_ij^2])`` and ``B = I``.
``fwsvd_rows`` is App. E's statement: the output rows weighted by ``sqrt(sum_j E[G_ij^2])``,
GFWSVD with ``A = I`` and ``B = diag(sum_j E[G_ij^2])``. The references below read the diagonal
Fisher off the dense ``nm x nm`` Fisher entry by entry (``vec`` column-major: ``F[i + n j, i + n j]
= E[G_ij^2]``), never through the code's reductions.
"""
import pytest
import torch

import fisherkron as fk
from fisherkron.core.methods import decompose_weight, method_weights
from fisherkron.core.wsvd import fwsvd_rows_weight, fwsvd_weight
from fisherkron.testing import F64_REL, FLOAT64, OPT_SLACK, dense_fisher

SHAPES = [(7, 5), (5, 7), (6, 6)]  # the square layer: where a swapped axis has the right length
RANKS = [1, 2, 4]
F64 = torch.float64
#: a swapped reduction axis moves the product by O(1) of W's entries; round-off is ~1e-15
DISTINCT = 1e-3


def _problem(n, m, seed):
    """``W`` (n x m) and ``k = 9`` gradients whose rows and columns both carry very different scales."""
    g = torch.Generator().manual_seed(seed)
    row = torch.logspace(-1, 1, n, dtype=F64)[torch.randperm(n, generator=g)]  # (n,)
    col = torch.logspace(-1, 1, m, dtype=F64)[torch.randperm(m, generator=g)]  # (m,)
    G = torch.randn(9, n, m, generator=g, dtype=F64) * row[:, None] * col[None, :]  # (k, n, m)
    W = torch.randn(n, m, generator=g, dtype=F64)  # (n, m)
    return g, W, G


def _reference_sums(G):
    """``(sum_i E[G_ij^2])_j`` (m) and ``(sum_j E[G_ij^2])_i`` (n), entry by entry from the dense Fisher."""
    k, n, m = G.shape
    Fd = torch.diagonal(dense_fisher(G))  # (n m,): E[G_ij^2] at i + n j
    cols = torch.tensor([sum(float(Fd[i + n * j]) for i in range(n)) for j in range(m)], dtype=F64)  # (m,)
    rows = torch.tensor([sum(float(Fd[i + n * j]) for j in range(m)) for i in range(n)], dtype=F64)  # (n,)
    return cols, rows


def _truncate(X, r):
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return (U[:, :r] * S[:r]) @ Vh[:r]


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("r", RANKS)
def test_input_form_is_gfwsvd_with_diagonal_A_and_identity_B(n, m, r):
    g, W, G = _problem(n, m, 3 * n + m + r)
    cols, _ = _reference_sums(G)
    W2, W1 = fk.fwsvd(W, (G * G).mean(0), r)
    assert W2.shape == (n, r) and W1.shape == (r, m)
    G2, G1 = fk.gfwsvd(W, torch.diag(cols), torch.eye(n, dtype=F64), r, min_alpha=0)
    torch.testing.assert_close(W2 @ W1, G2 @ G1, **FLOAT64)
    d = cols.sqrt()  # (m,)
    torch.testing.assert_close(W2 @ W1, _truncate(W * d[None, :], r) / d[None, :], **FLOAT64)  # SVD_r(W D) D^-1


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("r", RANKS)
def test_rows_form_is_gfwsvd_with_identity_A_and_diagonal_B(n, m, r):
    g, W, G = _problem(n, m, 5 * n + m + r)
    _, rows = _reference_sums(G)
    W2, W1 = fk.fwsvd_rows(W, (G * G).mean(0), r)
    assert W2.shape == (n, r) and W1.shape == (r, m)
    G2, G1 = fk.gfwsvd(W, torch.eye(m, dtype=F64), torch.diag(rows), r, min_alpha=0)
    torch.testing.assert_close(W2 @ W1, G2 @ G1, **FLOAT64)
    d = rows.sqrt()  # (n,)
    torch.testing.assert_close(W2 @ W1, _truncate(d[:, None] * W, r) / d[:, None], **FLOAT64)  # D^-1 SVD_r(D W)


@pytest.mark.parametrize("n,m", SHAPES)
def test_input_form_weights_are_the_best_diagonal_kronecker_fit(n, m):
    """The counterpart of App. E's argument: the best ``D~ (x) I_n`` fit of F has ``d_j = sum_i E[G_ij^2] / n``."""
    g, W, G = _problem(n, m, 11 + n)
    F = dense_fisher(G)  # (nm, nm)
    eye_n, eye_m = torch.eye(n, dtype=F64), torch.eye(m, dtype=F64)
    basis = torch.stack([fk.vec(torch.kron(torch.diag(eye_m[j]), eye_n)) for j in range(m)], dim=1)  # ((nm)^2, m)
    d = torch.linalg.lstsq(basis, fk.vec(F)[:, None]).solution[:, 0]  # (m,)
    cols, _ = _reference_sums(G)
    torch.testing.assert_close(d, cols / n, **FLOAT64)
    G2, G1 = fk.gfwsvd(W, torch.diag(d), eye_n, 2, min_alpha=0)  # a scale on A leaves the optimum unchanged
    torch.testing.assert_close(torch.matmul(*fk.fwsvd(W, (G * G).mean(0), 2)), G2 @ G1, **FLOAT64)


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("r", RANKS)
def test_error_in_own_norm_is_the_discarded_weighted_singular_values(n, m, r):
    g, W, G = _problem(n, m, 7 * n + m + r)
    cols, rows = _reference_sums(G)
    D = (G * G).mean(0)
    eye_m, eye_n = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)
    for form, (A, B) in {fk.fwsvd: (torch.diag(cols), eye_n), fk.fwsvd_rows: (eye_m, torch.diag(rows))}.items():
        dW = W - torch.matmul(*form(W, D, r))  # (n, m)
        LA, LB = A.sqrt(), B.sqrt()  # diagonal: their own Cholesky factors
        want = float((torch.linalg.svdvals(LB @ W @ LA)[r:] ** 2).sum())
        got = float((LB @ dW @ LA).norm() ** 2)  # ||(W - W_r) D||_F^2, or ||D (W - W_r)||_F^2
        assert abs(got - want) <= F64_REL * max(want, 1.0), form.__name__
        dense = float(fk.vec(dW) @ torch.kron(A, B) @ fk.vec(dW))  # vec(dW)^T (A (x) B) vec(dW)
        assert abs(dense - want) <= F64_REL * max(want, 1.0), form.__name__


@pytest.mark.parametrize("n,m", SHAPES)
def test_input_form_minimises_its_weighted_error(n, m):
    r = 2
    g, W, G = _problem(n, m, 40 + n * m)
    cols, _ = _reference_sums(G)
    d = cols.sqrt()[None, :]  # (1, m)

    def werr(Wr):
        return float(((W - Wr) * d).norm() ** 2)  # ||(W - W_r) D||_F^2

    W2, W1 = fk.fwsvd(W, (G * G).mean(0), r)
    best = werr(W2 @ W1)
    for eps in (1e-1, 1e-3, 1e-6):  # random rank-r perturbations of the optimum
        for _ in range(20):
            P2 = W2 + eps * torch.randn(W2.shape, generator=g, dtype=F64)
            P1 = W1 + eps * torch.randn(W1.shape, generator=g, dtype=F64)
            assert werr(P2 @ P1) >= best * (1 - OPT_SLACK)
    for _ in range(20):  # random rank-r matrices
        R = torch.randn(n, r, generator=g, dtype=F64) @ torch.randn(r, m, generator=g, dtype=F64)
        assert werr(R) > best
    rivals = {"svd": torch.matmul(*fk.svd(W, r)), "fwsvd_rows": torch.matmul(*fk.fwsvd_rows(W, (G * G).mean(0), r))}
    for name, Wr in rivals.items():  # generic weights: the other forms are strictly worse in this norm
        assert werr(Wr) > best * (1 + 1e-6), name


@pytest.mark.parametrize("n,m", SHAPES)
def test_each_form_reads_its_own_axis(n, m):
    """A Fisher whose column sums are all equal leaves ``fwsvd`` = SVD and moves ``fwsvd_rows``; and vice versa.

    Summing over the wrong index turns each statement into the other one's, so a swapped axis fails,
    on a square layer too (where the weight's length can not tell). The swap is checked to be far
    from the correct answer, so this test can fail.
    """
    r = 2
    g, W, _ = _problem(n, m, 70 + n)
    a = torch.logspace(-2, 2, n, dtype=F64)[torch.randperm(n, generator=g)]  # (n,)
    b = torch.logspace(-2, 2, m, dtype=F64)[torch.randperm(m, generator=g)]  # (m,)
    rows_vary = a[:, None] * torch.ones(1, m, dtype=F64)  # (n, m): equal column sums, unequal row sums
    cols_vary = torch.ones(n, 1, dtype=F64) * b[None, :]  # (n, m): equal row sums, unequal column sums
    plain = _truncate(W, r)
    by_rows = _truncate(a.sqrt()[:, None] * W, r) / a.sqrt()[:, None]  # D^-1 SVD_r(D W), d_i ~ sqrt(a_i)
    by_cols = _truncate(W * b.sqrt()[None, :], r) / b.sqrt()[None, :]  # SVD_r(W D) D^-1, d_j ~ sqrt(b_j)
    assert (by_rows - plain).abs().max() > DISTINCT and (by_cols - plain).abs().max() > DISTINCT
    torch.testing.assert_close(torch.matmul(*fk.fwsvd(W, rows_vary, r)), plain, **FLOAT64)
    torch.testing.assert_close(torch.matmul(*fk.fwsvd(W, cols_vary, r)), by_cols, **FLOAT64)
    torch.testing.assert_close(torch.matmul(*fk.fwsvd_rows(W, cols_vary, r)), plain, **FLOAT64)
    torch.testing.assert_close(torch.matmul(*fk.fwsvd_rows(W, rows_vary, r)), by_rows, **FLOAT64)
    assert fwsvd_weight(cols_vary).shape == (m,) and fwsvd_rows_weight(cols_vary).shape == (n,)


@pytest.mark.parametrize("n,m", SHAPES)
def test_method_table_rows_are_the_two_forms(n, m):
    """``fwsvd`` / ``fwsvd_rows`` in the method table: the same factors, weights on the stated side,
    and :meth:`Decomposition.errors` (what the ``fisher`` allocation reads) in the form's own metric."""
    r = 2
    g, W, G = _problem(n, m, 90 + n)
    D = (G * G).mean(0)
    cols, rows = _reference_sums(G)
    w = method_weights("fwsvd", n, m, diag_fisher=D)
    assert w.left is None and w.right.shape == (m,)
    w = method_weights("fwsvd_rows", n, m, diag_fisher=D)
    assert w.right is None and w.left.shape == (n,)
    eye_m, eye_n = torch.eye(m, dtype=F64), torch.eye(n, dtype=F64)
    for name, form, (A, B) in (("fwsvd", fk.fwsvd, (torch.diag(cols), eye_n)),
                               ("fwsvd_rows", fk.fwsvd_rows, (eye_m, torch.diag(rows)))):
        assert fk.METHODS[name].needs == ("diag_fisher",)
        torch.testing.assert_close(torch.matmul(*fk.factorize_weight(name, W, r, diag_fisher=D)),
                                   torch.matmul(*form(W, D, r)), **FLOAT64)
        errors = decompose_weight(name, W, diag_fisher=D).errors(A, B)  # (q + 1,)
        S = torch.linalg.svdvals(B.sqrt() @ W @ A.sqrt())
        want = torch.tensor([float((S[k:] ** 2).sum()) for k in range(min(n, m) + 1)], dtype=F64)
        assert ((errors - want).abs() <= F64_REL * want.max()).all(), name


def test_dead_units_are_floored_and_empty_statistics_refused():
    """A unit with no gradient gets the floor ``1e-6 * mean(d)`` (as ASVD's weights do), not a division by 0."""
    g, W, G = _problem(7, 5, 0)
    D = (G * G).mean(0)
    D[:, 2] = 0.0  # an input that never saw a gradient: column weight 0 before the floor
    d = fwsvd_weight(D)
    raw = D.sum(0).sqrt()
    assert float(d[2]) == pytest.approx(1e-6 * float(raw.mean()), rel=1e-12)
    torch.testing.assert_close(d[[0, 1, 3, 4]], raw[[0, 1, 3, 4]], **FLOAT64)
    assert torch.isfinite(torch.matmul(*fk.fwsvd(W, D, 2))).all()
    D = (G * G).mean(0)
    D[4] = 0.0  # an output that never saw a gradient: row weight 0 before the floor
    assert torch.isfinite(torch.matmul(*fk.fwsvd_rows(W, D, 2))).all()
    for form in (fk.fwsvd, fk.fwsvd_rows):
        with pytest.raises(fk.FisherkronError, match="zero everywhere"):
            form(W, torch.zeros(7, 5, dtype=F64), 2)
        with pytest.raises(fk.FisherkronError, match="NaN/inf"):
            form(W, torch.full((7, 5), float("nan"), dtype=F64), 2)
        with pytest.raises(fk.FisherkronError, match="not its row or column sums") as e:
            form(W, D.sum(0), 2)
        assert "\n" not in str(e.value)
    with pytest.raises(fk.FisherkronError, match="method fwsvd_rows needs diag_fisher"):
        fk.factorize_weight("fwsvd_rows", W, 2)
