"""Regularisation of Kronecker factors, K-FAC factors and the low-rank layer."""
import pytest
import torch

import fisherkron as fk
from fisherkron.testing import FLOAT64, MONTE_CARLO_REL, assert_close_f32, linear_scale


@pytest.mark.parametrize("method", ["diag", "shrink"])
@pytest.mark.parametrize("kind", ["singular", "indefinite", "dead unit"])
def test_regularize_makes_cholesky_exist(method, kind):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 3, generator=g, dtype=torch.float64)
    M = X @ X.T  # rank 3 of 6: singular
    if kind == "indefinite":
        M = M - 0.05 * torch.eye(6, dtype=torch.float64)
    if kind == "dead unit":
        M[2, :] = 0
        M[:, 2] = 0
    assert torch.linalg.cholesky_ex(M).info != 0
    reg = fk.regularize(M, method=method, min_alpha=0)
    assert reg.alpha > 0 and reg.method == method
    torch.testing.assert_close(reg.L @ reg.L.T, reg.matrix, **FLOAT64)
    assert torch.equal(reg.L, torch.tril(reg.L))
    d = torch.diagonal(M)
    if method == "diag" and kind != "dead unit":
        torch.testing.assert_close(reg.matrix, M + reg.alpha * torch.diag(d), **FLOAT64)
    if method == "shrink":
        want = (1 - reg.alpha) * M + reg.alpha * d.mean() * torch.eye(6, dtype=torch.float64)
        torch.testing.assert_close(reg.matrix, want, **FLOAT64)
        assert 0 < reg.alpha <= 1


def test_regularize_positive_definite_needs_no_alpha_and_fixed_alpha():
    M = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    assert fk.regularize(M, min_alpha=0).alpha == 0.0
    assert fk.regularize(M).alpha == fk.MIN_ALPHA  # the default floor
    assert fk.regularize(M, alpha=0.1).alpha == 0.1
    with pytest.raises(fk.FisherkronError, match="does not make it positive definite"):
        fk.regularize(-M, alpha=0.1)


@pytest.mark.parametrize("bad,msg", [
    (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), "NaN/inf"),
    (torch.ones(2, 3), "must be square"),
    (torch.zeros(3, 3), "zero on its diagonal"),
    (torch.ones(3), "2-D"),
])
def test_regularize_bad_input(bad, msg):
    with pytest.raises(fk.FisherkronError, match=msg) as e:
        fk.regularize(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(fk.FisherkronError, match="method must be"):
        fk.regularize(torch.eye(2), method="ridge")


def test_gfwsvd_regularizes_singular_factors():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(5, 4, generator=g, dtype=torch.float64)
    X = torch.randn(4, 2, generator=g, dtype=torch.float64)
    A = X @ X.T  # singular
    B = torch.eye(5, dtype=torch.float64)
    W2, W1 = fk.gfwsvd(W, A, B, 2)
    assert torch.isfinite(W2 @ W1).all()
    reg = fk.regularize(A)
    torch.testing.assert_close(W2 @ W1, torch.matmul(*fk.gfwsvd(W, reg, B, 2)), **FLOAT64)


def test_kfac_factors_dense_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, 5, generator=g, dtype=torch.float64)  # 3 batches x 10 tokens, m = 5
    d = torch.randn(3, 10, 7, generator=g, dtype=torch.float64)  # n = 7
    f = fk.kfac_factors(x, d, num_batches=3)
    X, D = x.reshape(-1, 5), d.reshape(-1, 7)
    torch.testing.assert_close(f.A, X.T @ X / 30, **FLOAT64)
    torch.testing.assert_close(f.B, D.T @ D / 3, **FLOAT64)
    # per-batch lists give the same factors
    f2 = fk.kfac_factors(list(x), list(d), num_batches=3)
    torch.testing.assert_close(f2.A, f.A, **FLOAT64)
    # one token per batch, independent x and delta: A (x) B -> F in expectation (Monte Carlo)
    k = 20000
    xs = torch.randn(k, 1, 2, generator=g, dtype=torch.float64) @ torch.tensor([[1.0, 0.5], [0.0, 1.0]],
                                                                              dtype=torch.float64)
    ds = torch.randn(k, 1, 3, generator=g, dtype=torch.float64)
    G = torch.einsum("ktn,ktm->knm", ds, xs)
    from fisherkron.testing import dense_fisher
    F = dense_fisher(G)
    fk_ = fk.kfac_factors(xs, ds, num_batches=k)
    assert float((torch.kron(fk_.A, fk_.B) - F).norm() / F.norm()) < MONTE_CARLO_REL
    with pytest.raises(fk.FisherkronError, match="rows"):
        fk.kfac_factors(torch.randn(4, 5), torch.randn(3, 7))


def test_lowrank_linear_forward_and_counts():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(5, 7)
    W2, W1 = fk.svd(lin.weight.detach(), 3)
    low = fk.LowRankLinear.from_factors(W2, W1, lin.bias.detach())
    x = torch.randn(4, 5, generator=g)
    scale, length = linear_scale(x, W1, W2, bias=lin.bias)  # float32 sums over m, then r
    assert_close_f32(low(x), x @ (W2 @ W1).T + lin.bias, length=length, scale=scale, what="LowRankLinear output")
    n_params = sum(p.numel() for p in low.parameters())
    assert n_params == fk.lowrank_params(7, 5, 3) == 3 * 12 + 7
    assert fk.rank_for_ratio(7, 5, 0.0) == 2  # floor(35 / 12)
    r = fk.rank_for_ratio(3072, 768, 0.5)
    assert fk.compression_ratio(3072 * 768, r * (3072 + 768)) >= 0.5
    assert fk.compression_ratio(3072 * 768, (r + 1) * (3072 + 768)) < 0.5
    with pytest.raises(fk.FisherkronError):
        fk.rank_for_ratio(7, 5, 1.0)
    with pytest.raises(fk.FisherkronError, match="rank 6"):
        fk.LowRankLinear(5, 7, 6)


def test_roundoff_negative_eigenvalues_do_not_force_a_large_alpha():
    """PSD up to round-off, with nearly dead units: the paper's rule then needs only a tiny alpha.

    Live units carry a rank-12 block; ten dead units carry a tiny diagonal plus symmetric
    round-off-sized noise (~1e-8 lambda_max), as MFF factors computed in float32 do.
    """
    g = torch.Generator().manual_seed(4)
    X = torch.randn(30, 12, generator=g, dtype=torch.float64)
    noise = 1e-7  # round-off-sized symmetric noise on the dead units
    tiny = 10 * noise  # what "round-off sized" means here, relative to lambda_max
    E = noise * torch.randn(10, 10, generator=g, dtype=torch.float64)
    M = torch.block_diag(X @ X.T, 1e-9 * torch.eye(10, dtype=torch.float64) + E + E.T)
    lam = torch.linalg.eigvalsh(M)
    assert -tiny * lam.max() < lam.min() < 0
    reg = fk.regularize(M, min_alpha=0)
    assert 0 < reg.clipped <= tiny and reg.alpha <= tiny
    torch.testing.assert_close(reg.L @ reg.L.T, reg.matrix, **FLOAT64)
    assert float((reg.matrix - M).norm() / M.norm()) < tiny  # the factor is barely changed
    unclipped = fk.regularize(M, psd_tol=0, min_alpha=0)
    assert unclipped.clipped == 0 and unclipped.alpha >= 1e-2  # what the plain rule would have needed
    # a genuinely indefinite factor is not "clipped"
    assert fk.regularize(M - 0.01 * torch.eye(40, dtype=torch.float64), min_alpha=0).clipped == 0


def test_min_alpha_floor():
    M = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    reg = fk.regularize(M, min_alpha=0.1)
    assert reg.alpha == 0.1
    torch.testing.assert_close(reg.matrix, M + 0.1 * torch.diag(torch.diagonal(M)), **FLOAT64)
    X = torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    floor = 1e-3
    assert fk.regularize(X @ X.T, min_alpha=floor).alpha >= floor
    with pytest.raises(fk.FisherkronError, match="min_alpha"):
        fk.regularize(M, min_alpha=-1.0)


def test_one_min_alpha_default_everywhere():
    """regularize, GFWSVD, SVD-LLM, the method table and model compression share one floor."""
    import inspect

    from fisherkron.hf.surgery import compress

    for fn in (fk.regularize, fk.gfwsvd, fk.svd_llm, fk.factorize_weight, compress):
        assert inspect.signature(fn).parameters["min_alpha"].default is fk.MIN_ALPHA, fn.__name__
    from fisherkron.cli import build_parser

    args = build_parser().parse_args(["compress", "smollm2", "--rank", "2", "--out", "x"])
    assert args.min_alpha == fk.MIN_ALPHA
