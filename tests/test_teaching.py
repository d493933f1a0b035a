"""``experiments.teaching.transform_pair`` against dense float64 references (issue 24, Fig. connection2fwsvd).

The references build each method's pair from its definition: the identity for SVD, the diagonal
Fisher read entry by entry off the dense ``nm x nm`` Fisher for the two FWSVD forms (``vec``
column-major: ``F[i + n j, i + n j] = E[G_ij^2]``), and ``A + alpha diag(A)``, ``B + alpha diag(B)``
for GFWSVD. Then the dense pair, pushed through Eq. (7) with explicit inverses, must give the
library's factors at every rank: a pair with swapped sides, a transposed factor or a wrong
reduction axis fails on the non-square layers.
"""
import pytest
import torch

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.methods import factorize_weight
from fisherkron.experiments.teaching import TransformPair, dense_weight, offdiagonal_share, transform_pair
from fisherkron.testing import FLOAT64, dense_fisher

SHAPES = [(7, 5), (5, 7), (6, 6)]
F64 = torch.float64
ALPHA = 0.05  # a fixed regularisation, so the GFWSVD reference is A + alpha diag(A) exactly
#: Eq. (7) through explicit inverses of well-conditioned 5-7 dimensional factors: round-off ~1e-13
EQ7 = dict(rtol=1e-8, atol=1e-10)


def _problem(n, m, seed=0):
    """``W`` (n x m), ``k = 12`` gradients with unequal row and column scales, and MFF's factors."""
    g = torch.Generator().manual_seed(seed)
    row = torch.logspace(-1, 1, n, dtype=F64)[torch.randperm(n, generator=g)]  # (n,)
    col = torch.logspace(-1, 1, m, dtype=F64)[torch.randperm(m, generator=g)]  # (m,)
    G = torch.randn(12, n, m, generator=g, dtype=F64) * row[:, None] * col[None, :]  # (k, n, m)
    W = torch.randn(n, m, generator=g, dtype=F64)  # (n, m)
    res = fk.mff(G, dtype=F64)
    return W, G, res.A, res.B


def _references(W, G, A, B):
    """The dense ``(L_B, L_A)`` of each method, from the definitions (not from the library's weights)."""
    n, m = W.shape
    Fd = torch.diagonal(dense_fisher(G))  # (n m,): E[G_ij^2] at i + n j
    rows = torch.tensor([sum(float(Fd[i + n * j]) for j in range(m)) for i in range(n)], dtype=F64)  # (n,)
    cols = torch.tensor([sum(float(Fd[i + n * j]) for i in range(n)) for j in range(m)], dtype=F64)  # (m,)
    In, Im = torch.eye(n, dtype=F64), torch.eye(m, dtype=F64)
    return {
        "svd": (In, Im),
        "fwsvd_rows": (torch.diag(rows.sqrt()), Im),  # App. E: D_ii = sqrt(sum_j E[G_ij^2])
        "fwsvd": (In, torch.diag(cols.sqrt())),  # its code: C_jj = sqrt(sum_i E[G_ij^2])
        "gfwsvd": (torch.linalg.cholesky(B + ALPHA * torch.diag(torch.diagonal(B))),
                   torch.linalg.cholesky(A + ALPHA * torch.diag(torch.diagonal(A)))),
    }


def _eq7(W, L_B, L_A, r):
    """``L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}`` with explicit inverses (dense reference)."""
    U, S, Vh = torch.linalg.svd(L_B.T @ W @ L_A)  # (n, q), (q,), (q, m)
    return torch.linalg.inv(L_B.T) @ (U[:, :r] * S[:r]) @ Vh[:r] @ torch.linalg.inv(L_A)  # (n, m)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_equal_the_dense_references(shape):
    W, G, A, B = _problem(*shape)
    stats = dict(A=A, B=B, diag_fisher=(G * G).mean(0), alpha=ALPHA)
    for method, (ref_B, ref_A) in _references(W, G, A, B).items():
        pair = transform_pair(method, W, **stats)
        assert isinstance(pair, TransformPair)
        assert pair.L_B.dtype == F64 and pair.L_A.dtype == F64
        assert torch.allclose(pair.L_B, ref_B, **FLOAT64), f"{method}: L_B (output side, n x n)"
        assert torch.allclose(pair.L_A, ref_A, **FLOAT64), f"{method}: L_A (input side, m x m)"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_give_the_librarys_factors_through_eq7(shape):
    W, G, A, B = _problem(*shape, seed=1)
    stats = dict(A=A, B=B, diag_fisher=(G * G).mean(0), alpha=ALPHA)
    for method in ("svd", "fwsvd_rows", "fwsvd", "gfwsvd"):
        pair = transform_pair(method, W, **stats)
        for r in range(1, min(shape) + 1):
            got = torch.matmul(*factorize_weight(method, W, r, **stats))
            assert torch.allclose(_eq7(W, pair.L_B, pair.L_A, r), got, **EQ7), f"{method} at rank {r}"


def test_gfwsvd_pair_is_lower_triangular_and_reports_its_regularisation():
    W, G, A, B = _problem(7, 5)
    pair = transform_pair("gfwsvd", W, A=A, B=B, alpha=ALPHA)
    assert torch.equal(pair.L_B, torch.tril(pair.L_B)) and torch.equal(pair.L_A, torch.tril(pair.L_A))
    assert (pair.alpha_A, pair.alpha_B) == (ALPHA, ALPHA)
    svd_pair = transform_pair("svd", W)
    assert svd_pair.alpha_A is None and svd_pair.alpha_B is None


def test_the_two_fwsvd_forms_are_mirror_images():
    """``fwsvd`` of ``W`` weights the same axis as ``fwsvd_rows`` of ``W^T`` with the transposed Fisher."""
    W, G, _, _ = _problem(7, 5, seed=2)
    cols = transform_pair("fwsvd", W, diag_fisher=(G * G).mean(0))
    rows_T = transform_pair("fwsvd_rows", W.T, diag_fisher=(G * G).mean(0).T)
    assert torch.allclose(cols.L_A, rows_T.L_B, **FLOAT64)
    assert torch.equal(cols.L_B, torch.eye(7, dtype=F64)) and torch.equal(rows_T.L_A, torch.eye(7, dtype=F64))


def test_missing_statistics_are_refused_naming_the_layer():
    W = torch.randn(7, 5, dtype=F64)
    with pytest.raises(FisherkronError, match="gfwsvd needs the Kronecker factors.*layer enc.3"):
        transform_pair("gfwsvd", W, layer="enc.3")


def test_dense_weight_and_offdiagonal_share():
    v = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    assert torch.equal(dense_weight(v, 3), torch.diag(v))
    M = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=F64)
    assert torch.equal(dense_weight(M, 2), M)
    assert offdiagonal_share(torch.diag(v)) == 0.0
    assert offdiagonal_share(M) == pytest.approx(3.0 / float(M.norm()), rel=1e-12)
