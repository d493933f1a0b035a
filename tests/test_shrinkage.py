"""GFWSVD with MFF's factors shrunk toward their diagonals (``gfwsvd_shrunk``), against dense float64 references.

* ``A_lambda = (1 - lambda) A + lambda diag(A)``; its two ends are GFWSVD and the diagonal ablation;
* the equivalence with the paper's ``"diag"`` regularisation at ``alpha = lambda / (1 - lambda)``;
* Theorem 1 with shrunk factors: the factors' product is the dense optimum in the ``A_lambda (x) B_lambda``
  metric on a small non-square layer (float64, from an eigendecomposition, not the library's kernel);
* the split-half intensity equals its formula computed by hand, is scale-free, and tracks the noise:
  near 0 for a strongly correlated factor seen through many gradients, large for a diagonal one seen
  through few;
* the calibration entry's halves are MFF of the even and odd batches, kept and read back; the method
  compresses a tiny model end to end.
"""
import math

import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.methods import factorize_weight
from fisherkron.core.shrinkage import shrink_to_diagonal, shrinkage_alpha, split_half_intensity
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.surgery import compress
from tiny_models import tiny_llama, token_batches

F64 = 1e-10


def _spd(d, seed, corr=0.6):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(d, d, generator=g, dtype=torch.float64)
    return X @ X.T * corr + torch.diag(torch.rand(d, generator=g, dtype=torch.float64) + 0.5)


def _product(f):
    return (f.W2 @ f.W1).double()


# ------------------------------------------------------------------------------------------ the shrunk factor
def test_ends_and_middle():
    A = _spd(5, 0)
    assert torch.equal(shrink_to_diagonal(A, 0.0), A)
    assert torch.equal(shrink_to_diagonal(A, 1.0), torch.diag(torch.diagonal(A)))
    S = shrink_to_diagonal(A, 0.3)
    assert torch.allclose(torch.diagonal(S), torch.diagonal(A))
    off = ~torch.eye(5, dtype=torch.bool)
    assert torch.allclose(S[off], 0.7 * A[off])
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(FisherkronError, match=r"\[0, 1\]"):
            shrink_to_diagonal(A, bad)
    assert shrinkage_alpha(0.75) == pytest.approx(3.0)
    with pytest.raises(FisherkronError, match="gfwsvd_diag"):
        shrinkage_alpha(1.0)


@pytest.mark.parametrize("lam", [0.0, 0.2, 0.9])
def test_equals_diag_regularisation(lam):
    """GFWSVD is scale-free in A and B, so shrinkage lambda is the 'diag' rule at alpha = lambda / (1 - lambda)."""
    n, m, r = 6, 4, 2
    W = torch.randn(n, m, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    A, B = _spd(m, 2), _spd(n, 3)
    shrunk = factorize_weight("gfwsvd_shrunk", W, r, A=A, B=B, shrinkage=(lam, lam), min_alpha=0.0)
    diag_rule = factorize_weight("gfwsvd", W, r, A=A, B=B, alpha=shrinkage_alpha(lam))
    assert torch.allclose(_product(shrunk), _product(diag_rule), rtol=0, atol=F64)


def test_two_ends_are_gfwsvd_and_its_diagonal():
    n, m, r = 5, 7, 3
    W = torch.randn(n, m, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    A, B = _spd(m, 5), _spd(n, 6)
    plain = factorize_weight("gfwsvd", W, r, A=A, B=B)
    zero = factorize_weight("gfwsvd_shrunk", W, r, A=A, B=B, shrinkage=(0.0, 0.0))
    assert torch.allclose(_product(zero), _product(plain), rtol=0, atol=F64)
    diag = factorize_weight("gfwsvd_diag", W, r, A=A, B=B)
    one = factorize_weight("gfwsvd_shrunk", W, r, A=A, B=B, shrinkage=(1.0, 1.0))
    assert torch.allclose(_product(one), _product(diag), rtol=0, atol=F64)
    with pytest.raises(FisherkronError, match="shrinkage intensities"):
        factorize_weight("gfwsvd_shrunk", W, r, A=A, B=B)


def test_theorem_one_with_shrunk_factors_dense_reference():
    """W_r = L_B^-T SVD_r(L_B^T W L_A) L_A^-1 in the metric of the shrunk factors, recomputed with numpy."""
    n, m, r, lam_A, lam_B = 5, 3, 2, 0.4, 0.7
    W = np.random.default_rng(7).standard_normal((n, m))
    A, B = _spd(m, 8).numpy(), _spd(n, 9).numpy()
    As = (1 - lam_A) * A + lam_A * np.diag(np.diag(A))
    Bs = (1 - lam_B) * B + lam_B * np.diag(np.diag(B))
    LA, LB = np.linalg.cholesky(As), np.linalg.cholesky(Bs)
    U, s, Vt = np.linalg.svd(LB.T @ W @ LA)
    ref = np.linalg.solve(LB.T, U[:, :r] * s[:r]) @ Vt[:r] @ np.linalg.inv(LA)
    got = factorize_weight("gfwsvd_shrunk", torch.from_numpy(W), r, A=torch.from_numpy(A), B=torch.from_numpy(B),
                           shrinkage=(lam_A, lam_B), min_alpha=0.0)
    np.testing.assert_allclose(_product(got).numpy(), ref, rtol=0, atol=F64)
    # the discarded tail is the error in that metric: vec(dW)^T (As (x) Bs) vec(dW) = tr(dW^T Bs dW As)
    dW = W - ref
    assert np.trace(dW.T @ Bs @ dW @ As) == pytest.approx(float((s[r:] ** 2).sum()), rel=1e-10)


# ------------------------------------------------------------------------------------------ the intensity
def test_intensity_formula_by_hand():
    rng = np.random.default_rng(3)
    F, F1, F2 = (_spd(4, s).numpy() for s in (10, 11, 12))
    F1 = F1 * 3.0  # a scale MFF may put on either factor: removed by the unit trace

    def unit(X):
        return X / np.trace(X)
    off = ~np.eye(4, dtype=bool)
    ref = ((unit(F1) - unit(F2))[off] ** 2).sum() / 4 / (unit(F)[off] ** 2).sum()
    got = split_half_intensity(torch.from_numpy(F), torch.from_numpy(F1), torch.from_numpy(F2))
    assert got == pytest.approx(min(ref, 1.0), rel=1e-12)
    assert rng is not None
    assert split_half_intensity(torch.from_numpy(F), torch.from_numpy(F2), torch.from_numpy(F2)) == 0.0
    D = torch.diag(torch.tensor([1.0, 2.0, 3.0]))
    assert split_half_intensity(D, D + 0.1, D) == 1.0  # nothing off the diagonal to keep
    with pytest.raises(FisherkronError, match="positive trace"):
        split_half_intensity(-torch.eye(3), torch.eye(3), torch.eye(3))
    with pytest.raises(FisherkronError, match="do not match"):
        split_half_intensity(torch.eye(3), torch.eye(2), torch.eye(3))


def _kronecker_gradients(k, A, B, seed):
    """G_i = L_B Z_i L_A^T with Z_i standard normal: E[vec G vec G^T] = A (x) B exactly."""
    g = torch.Generator().manual_seed(seed)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    Z = torch.randn(k, B.shape[0], A.shape[0], generator=g, dtype=torch.float64)
    return LB @ Z @ LA.T


def _intensities(G):
    full, h1, h2 = fk.mff(G, dtype=torch.float64), fk.mff(G[0::2], dtype=torch.float64), fk.mff(G[1::2], dtype=torch.float64)
    return (split_half_intensity(full.A, h1.A, h2.A), split_half_intensity(full.B, h1.B, h2.B))


def test_intensity_tracks_the_noise():
    n, m = 6, 5
    corr_A = torch.full((m, m), 0.8, dtype=torch.float64) + 0.2 * torch.eye(m, dtype=torch.float64)
    corr_B = torch.full((n, n), 0.8, dtype=torch.float64) + 0.2 * torch.eye(n, dtype=torch.float64)
    many = _intensities(_kronecker_gradients(2000, corr_A, corr_B, 0))
    assert max(many) < 0.05  # strong true correlations seen through many gradients: keep them
    few = _intensities(_kronecker_gradients(8, torch.eye(m, dtype=torch.float64), torch.eye(n, dtype=torch.float64), 1))
    assert min(few) > 0.4  # no true correlation, few gradients: the off-diagonals are mostly noise


# ------------------------------------------------------------------------------------------ on a model
MFF = dict(max_matvecs=60)


def test_calibration_halves_and_compression(tmp_path):
    model = tiny_llama()
    st = collect_calibration(model, token_batches(k=4, seed=0, B=2, T=10), None, cache_dir=tmp_path)
    name = next(iter(st.layers))
    h1, h2 = st.kronecker_halves(name, **MFF)
    G = fk.GradientStack(st.gradients(name)).stacked()
    start = st.kfac(name)
    for h, got in ((0, h1), (1, h2)):
        ref = fk.mff(G[h::2], init=start, **MFF)
        assert torch.allclose(got["A"], ref.A) and torch.allclose(got["B"], ref.B)
    assert not list((st.dir / "mff").glob(f"{name}.*.half*.pt"))  # the halves' factors are not kept

    lam = st.shrinkage(name, **MFF)
    full = st.kronecker(name, **MFF)
    assert lam == (split_half_intensity(full["A"], h1["A"], h2["A"]), split_half_intensity(full["B"], h1["B"], h2["B"]))
    kept = list((st.dir / "mff").glob(f"{name}.*.shrinkage.pt"))
    assert len(kept) == 1 and kept[0].stat().st_size < 4096  # two numbers and a checksum
    assert st.shrinkage(name, **MFF) == lam  # read back
    torch.save({"lambda_A": 0.5, "lambda_B": 0.5, "check": "0" * 40}, kept[0])  # damaged: computed again
    assert st.shrinkage(name, **MFF) == lam

    before = sum(p.numel() for p in model.parameters())
    rep = compress(model, "gfwsvd_shrunk", st, None, ratio=0.3, mff_options=MFF)
    assert rep.layers_ratio > 0.2
    assert sum(p.numel() for p in model.parameters()) < before
    ids = token_batches(k=1, seed=5, B=1, T=8)[0]["input_ids"]
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_halves_need_two_batches(tmp_path):
    model = tiny_llama()
    st = collect_calibration(model, token_batches(k=1, seed=0, B=2, T=10), None, cache_dir=tmp_path)
    with pytest.raises(FisherkronError, match="at least 2 batches"):
        st.kronecker_halves(next(iter(st.layers)))
