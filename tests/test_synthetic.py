"""fisherkron.experiments.synthetic: the Sec. 6.1 experiment's building blocks."""
import math

import pandas as pd
import pytest
import torch

from fisherkron.experiments import synthetic as S
from fisherkron.core.conventions import FisherkronError

FLOAT64 = dict(rtol=1e-10, atol=1e-12)  # exact identities in float64
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # model outputs in float32 through a factorised layer


@pytest.mark.parametrize("kind", S.COVARIANCES)
def test_covariance_is_a_correlation_matrix(kind):
    Sigma = S.covariance(kind, 7, rho=0.8, seed=3)
    assert Sigma.shape == (7, 7)
    torch.testing.assert_close(Sigma, Sigma.T, **FLOAT64)
    torch.testing.assert_close(Sigma.diagonal(), torch.ones(7, dtype=torch.float64), **FLOAT64)
    assert torch.linalg.eigvalsh(Sigma).min() > 0


def test_covariance_structures():
    T = S.covariance("toeplitz", 5, rho=0.9)
    assert math.isclose(float(T[0, 3]), 0.9 ** 3) and math.isclose(float(T[4, 1]), 0.9 ** 3)
    A1, A2 = S.covariance("anisotropic", 6, seed=0), S.covariance("anisotropic", 6, seed=1)
    off = A1 - torch.diag(A1.diagonal())
    assert off.abs().max() > 0.1 and not torch.equal(A1, A2)
    torch.testing.assert_close(A1, S.covariance("anisotropic", 6, seed=0), **FLOAT64)
    with pytest.raises(FisherkronError):
        S.covariance("banded", 4)
    with pytest.raises(FisherkronError):
        S.covariance("toeplitz", 4, rho=1.0)


def test_make_task_draws_from_sigma_with_balanced_labels():
    task = S.make_task("toeplitz", 6, 20000, 100, rho=0.7, teacher_width=3, seed=0)
    assert task.X_train.shape == (20000, 6) and task.X_val.shape == (100, 6)
    emp = (task.X_train.double().T @ task.X_train.double()) / 20000
    assert (emp - task.Sigma).abs().max() < 0.05
    assert abs(task.y_train.float().mean().item() - 0.5) < 0.01
    assert set(task.y_val.unique().tolist()) <= {0, 1}


def _trained(kind="toeplitz", seed=0):
    cfg = S.SyntheticConfig(d=8, hidden=[12, 10], n_train=256, n_val=128, epochs=2, batch_size=32,
                            teacher_width=2, k=6, calib_batch_size=16, ranks=[1, 2, 8])
    task = S.make_task(kind, cfg.d, cfg.n_train, cfg.n_val, rho=0.9, teacher_width=cfg.teacher_width, seed=seed)
    model = S.make_mlp(cfg.d, cfg.hidden, seed=seed)
    S.train_mlp(model, task, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=seed)
    return cfg, task, model


def test_batch_gradients_match_autograd_on_the_full_batch():
    _, task, model = _trained()
    X, y = task.X_train[:40], task.y_train[:40]
    G = S.batch_gradients(model, 1, X, y, k=1, batch_size=40)  # one batch = all 40 examples
    assert G.shape == (1, 10, 12) and G.dtype == torch.float64
    loss = torch.nn.functional.cross_entropy(model(X), y)
    (ref,) = torch.autograd.grad(loss, model[2].weight)
    torch.testing.assert_close(G[0], ref.double(), rtol=1e-5, atol=1e-7)
    G5 = S.batch_gradients(model, 0, X, y, k=5, batch_size=16)  # wraps around the 40 examples
    assert G5.shape == (5, 12, 8) and not torch.allclose(G5[0], G5[1])
    torch.testing.assert_close(S.diagonal_fisher(G5), (G5 ** 2).mean(0), **FLOAT64)


def test_full_rank_compression_keeps_the_model_and_low_rank_truncates():
    _, task, model = _trained()
    G = S.batch_gradients(model, 0, task.X_train, task.y_train, k=6, batch_size=16)
    res = S.kronecker_factors(G)
    n, m = model[0].weight.shape
    x = task.X_val
    for method in S.COMPARED:
        comp = S.compress_layer(model, 0, method, min(n, m), A=res.A, B=res.B, fisher_diag=S.diagonal_fisher(G))
        torch.testing.assert_close(comp(x), model(x), **FLOAT32)
        low = S.compress_layer(model, 0, method, 2, A=res.A, B=res.B, fisher_diag=S.diagonal_fisher(G))
        assert low[0].rank == 2 and int(torch.linalg.matrix_rank(low[0].weight.detach(), rtol=1e-5)) == 2
    W = model[0].weight.detach().double()
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    low = S.compress_layer(model, 0, "svd", 3)
    torch.testing.assert_close(low[0].weight.detach().double(), U[:, :3] * s[:3] @ Vh[:3], rtol=1e-5, atol=1e-6)
    eye = S.compress_layer(model, 0, "gfwsvd", 3, A=torch.eye(m, dtype=torch.float64),
                           B=torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(eye[0].weight, low[0].weight, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(S.compress_layer(model, 0, "gfwsvd", 3, A=res.A, B=res.B)[0].weight,
                              low[0].weight, atol=1e-3)
    with pytest.raises(FisherkronError):
        S.compress_layer(model, 0, "gfwsvd", 2)
    with pytest.raises(FisherkronError):
        S.compress_layer(model, 5, "svd", 2)


def test_run_seed_rows():
    cfg, _, _ = _trained()
    rows = S.run_seed("anisotropic", 1, cfg)
    assert len(rows) == 1 + len(cfg.methods) * len(cfg.ranks)
    df = pd.DataFrame(rows)
    assert (df["method"] == "dense").sum() == 1 and df["accuracy"].between(0, 1).all()
    assert (df["covariance"] == "anisotropic").all() and (df["seed"] == 1).all()
    assert 0 < df["fisher_share"].iloc[0] <= 1 + 1e-9
    assert S.summarize(df).shape[0] == 1 + len(cfg.methods) * len(cfg.ranks)


def _fake_results(gap):
    """Two seeds, ranks 1 and 4; gfwsvd beats fwsvd by gap[kind] (+/- 0.01 between seeds) at rank 1 only."""
    rows = []
    for kind in S.COVARIANCES:
        for seed, jitter in ((0, -0.01), (1, 0.01)):
            rows.append(dict(covariance=kind, seed=seed, method="dense", rank=math.nan, accuracy=0.9))
            for r in (1, 4):
                base = 0.6 if r == 1 else 0.85
                rows.append(dict(covariance=kind, seed=seed, method="fwsvd", rank=r, accuracy=base))
                rows.append(dict(covariance=kind, seed=seed, method="svd", rank=r, accuracy=base - 0.1))
                extra = gap[kind] + jitter if r == 1 else 0.0
                rows.append(dict(covariance=kind, seed=seed, method="gfwsvd", rank=r, accuracy=base + extra))
    return pd.DataFrame(rows)


def test_accuracy_gaps_and_claim_check():
    df = _fake_results({"isotropic": 0.0, "anisotropic": 0.04, "toeplitz": 0.1})
    gaps = S.accuracy_gaps(df, max_rank=1)
    fw = gaps[gaps["versus"] == "fwsvd"].set_index("covariance")
    assert list(fw.index) == list(S.COVARIANCES)
    assert math.isclose(fw.loc["toeplitz", "gap"], 0.1) and math.isclose(fw.loc["isotropic", "gap"], 0.0, abs_tol=1e-12)
    assert math.isclose(fw.loc["anisotropic", "se"], 0.01, rel_tol=1e-9)  # std 0.01*sqrt(2), over sqrt(2)
    assert (fw["seeds"] == 2).all()
    sv = gaps[gaps["versus"] == "svd"].set_index("covariance")
    assert math.isclose(sv.loc["isotropic", "gap"], 0.1)
    all_ranks = S.accuracy_gaps(df).query("versus == 'fwsvd'").set_index("covariance")
    assert math.isclose(all_ranks.loc["toeplitz", "gap"], 0.05)  # averaged with the zero gap at rank 4
    assert S.claim_check(gaps) == {"diagonal_fine_isotropic": True, "gap_grows_with_correlation": True,
                                   "largest_for_toeplitz": True, "diagonal_fine_isotropic_within_noise": True,
                                   "anisotropic_above_isotropic": True, "toeplitz_above_anisotropic": True,
                                   "toeplitz_positive": True}
    # se of every gap is 0.01: 0.04 vs 0.0 is 2.8 se(diff) apart, 0.1 vs 0.04 is 4.2; with z=3 only the latter
    loose = S.claim_check(gaps, z=3.0)
    assert not loose["anisotropic_above_isotropic"] and loose["toeplitz_above_anisotropic"]
    bad = S.accuracy_gaps(_fake_results({"isotropic": 0.05, "anisotropic": 0.08, "toeplitz": 0.02}), max_rank=1)
    assert S.claim_check(bad) == {"diagonal_fine_isotropic": False, "gap_grows_with_correlation": False,
                                  "largest_for_toeplitz": False, "diagonal_fine_isotropic_within_noise": False,
                                  "anisotropic_above_isotropic": True, "toeplitz_above_anisotropic": False,
                                  "toeplitz_positive": False}
    with pytest.raises(FisherkronError):
        S.accuracy_gaps(df, reference="asvd")
