"""The teaching notebook's stochastic facts, checked with seeded draws (Secs. 5-6 of
``notebooks/kronecker_fisher_from_scratch.py``).

The notebook checks the closed forms; the facts below need many random draws, so they live here:

* Sec. 5: ``X = M + L_1 Z L_2^T`` with ``Z`` standard normal has ``Cov(vec X) = Sigma_2 (x) Sigma_1``:
  the sample covariance of many draws converges to it (and not to the swapped ``Sigma_1 (x) Sigma_2``).
* Sec. 6 (Theorem 1): no rank-``r`` matrix has a smaller Fisher-weighted error
  ``tr((W - P)^T B (W - P) A)`` than GFWSVD's ``W_r``: neither random rank-``r`` matrices near the
  optimum and far from it, nor local optima of ``(W_2, W_1)`` found by L-BFGS from random starts,
  which must reach the closed form.

Each runs on the notebook's tiny layer (4 x 3, k = 32 softmax gradients) and on a 7 x 5 layer.
"""
import pytest
import torch
from torch import nn

import fisherkron as fk
from fisherkron.testing import OPT_SLACK

F64 = torch.float64
SHAPES = [(4, 3), (7, 5)]
#: relative Frobenius error of a sample covariance of DRAWS draws in nm <= 35 dimensions: its standard
#: deviation is about sqrt(nm / DRAWS) <= 0.019; 0.05 leaves 2.5 of them and the swapped Kronecker order
#: is off by more than 0.15 on these factors (checked below)
DRAWS = 100_000
MONTE_CARLO = 0.05
COMPETITORS = 500  # random rank-r matrices near the optimum, and as many far from it
RESTARTS = 4  # L-BFGS starts
#: L-BFGS on the smooth quadratic reaches the closed-form optimum to this relative excess
LOCAL_REACH = 1e-4


def _layer(n, m, seed=0, T=8, k=32):
    """The notebook's Sec. 1 problem: softmax cross-entropy gradients of an ``n x m`` layer, MFF's factors,
    regularised as Sec. 5 regularises them (``alpha = 0.01``)."""
    torch.manual_seed(seed)
    layer = nn.Linear(m, n, dtype=F64)
    X = torch.randn(k, T, m, dtype=F64)  # (k, T, m)
    Y = torch.randint(0, n, (k, T))  # (k, T)
    G = torch.stack([torch.autograd.grad(nn.functional.cross_entropy(layer(Xi), Yi), layer.weight)[0]
                     for Xi, Yi in zip(X, Y)])  # (k, n, m)
    res = fk.mff(G, dtype=F64)
    regA, regB = fk.regularize(res.A, alpha=0.01), fk.regularize(res.B, alpha=0.01)
    return layer.weight.detach().clone(), G, regA, regB


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matrix_normal_sample_covariance(shape):
    n, m = shape
    _, _, regA, regB = _layer(n, m)
    Sigma1, Sigma2 = torch.linalg.inv(regB.matrix), torch.linalg.inv(regA.matrix)  # (n, n) rows, (m, m) columns
    L1, L2 = torch.linalg.cholesky(Sigma1), torch.linalg.cholesky(Sigma2)
    gen = torch.Generator().manual_seed(1)
    Z = torch.randn(DRAWS, n, m, dtype=F64, generator=gen)  # (draws, n, m)
    samples = fk.vec(L1 @ Z @ L2.T)  # (draws, n m): vec(X - M)
    cov = samples.T @ samples / DRAWS  # (n m, n m)
    truth = fk.kron(Sigma2, Sigma1)
    rel = float(torch.linalg.norm(cov - truth) / torch.linalg.norm(truth))
    assert rel < MONTE_CARLO, f"sample covariance of vec(X) against Sigma2 (x) Sigma1: relative error {rel:.3f}"
    swapped = fk.kron(Sigma1, Sigma2)  # (n m, n m) too, with the wrong block structure
    rel_swapped = float(torch.linalg.norm(cov - swapped) / torch.linalg.norm(swapped))
    assert rel_swapped > 3 * MONTE_CARLO, f"the test tells the Kronecker order apart ({rel_swapped:.3f})"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rank", [1, 2])
def test_no_random_rank_r_matrix_beats_theorem_1(shape, rank):
    n, m = shape
    W, _, regA, regB = _layer(n, m, seed=2)
    A, B = regA.matrix, regB.matrix
    W2, W1 = fk.gfwsvd(W, regA, regB, rank)  # (n, r), (r, m)
    err_opt = fk.fisher_weighted_error(W, W2 @ W1, A, B)
    gen = torch.Generator().manual_seed(3)
    E2 = torch.randn(COMPETITORS, n, rank, dtype=F64, generator=gen)  # (c, n, r)
    E1 = torch.randn(COMPETITORS, rank, m, dtype=F64, generator=gen)  # (c, r, m)
    eps = torch.logspace(-4, 0, COMPETITORS, dtype=F64)[:, None, None]  # sizes of the moves away from the optimum
    near = (W2 + eps * E2) @ (W1 + eps * E1)  # (c, n, m)
    far = E2 @ E1 * (W.norm() / (E2 @ E1).flatten(1).norm(dim=1))[:, None, None]  # (c, n, m), scaled like W
    P = torch.cat([near, far])  # (2c, n, m)
    assert int(torch.linalg.matrix_rank(P).max()) <= rank, "competitors have rank <= r"
    D = W - P  # (2c, n, m)
    errs = torch.einsum("cia,ij,cjb,ba->c", D, B, D, A)  # tr(D^T B D A) per competitor
    assert float(errs.min()) >= err_opt * (1 - OPT_SLACK), "no random rank-r matrix beats Theorem 1"
    assert float(errs[:10].min()) <= err_opt * (1 + 1e-3), "the nearest competitors come close (the test has teeth)"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_local_optimisation_reaches_but_never_beats_theorem_1(shape):
    n, m = shape
    rank = 1
    W, _, regA, regB = _layer(n, m, seed=4)
    A, B = regA.matrix, regB.matrix
    err_opt = fk.fisher_weighted_error(W, torch.matmul(*fk.gfwsvd(W, regA, regB, rank)), A, B)
    best = float("inf")
    for restart in range(RESTARTS):
        gen = torch.Generator().manual_seed(10 + restart)
        V2 = torch.randn(n, rank, dtype=F64, generator=gen).requires_grad_()
        V1 = torch.randn(rank, m, dtype=F64, generator=gen).requires_grad_()
        opt = torch.optim.LBFGS([V2, V1], max_iter=300, tolerance_grad=1e-14, tolerance_change=1e-16,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            D = W - V2 @ V1
            e = torch.trace(D.T @ B @ D @ A)
            e.backward()
            return e

        opt.step(closure)
        err = fk.fisher_weighted_error(W, (V2 @ V1).detach(), A, B)
        assert err >= err_opt * (1 - OPT_SLACK), f"restart {restart}: a local optimum beat Theorem 1"
        best = min(best, err)
    assert best <= err_opt * (1 + LOCAL_REACH), f"local optimisation reaches the closed form ({best:.6e} vs {err_opt:.6e})"
