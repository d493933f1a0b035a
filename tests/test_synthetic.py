"""fisherkron.experiments.synthetic: the Sec. 6.1 experiment's building blocks."""
import math

import pandas as pd
import pytest
import torch

from fisherkron.experiments import synthetic as S
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.testing import (DISTINCT_REL, F64_REL, FLOAT64, MONTE_CARLO_REL, abs_sum_scale, assert_close_f32,
                                float32_tol, linear_scale, rel_error)


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
    assert (emp - task.Sigma).abs().max() < MONTE_CARLO_REL  # 20,000 draws; Sigma has a unit diagonal
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
    cap = {}
    hook = model[2].register_forward_hook(lambda m, i, o: cap.update(h=i[0], s=o))
    loss = torch.nn.functional.cross_entropy(model(X), y)
    hook.remove()
    ref, delta = torch.autograd.grad(loss, [model[2].weight, cap["s"]])  # (10, 12), (40, 10)
    # G = sum_t delta_t h_t^T: a float32 sum over the 40 examples
    assert_close_f32(G[0], ref, length=40, scale=abs_sum_scale(delta, cap["h"]), what="batch gradient")
    G5 = S.batch_gradients(model, 0, X, y, k=5, batch_size=16)  # wraps around the 40 examples
    assert G5.shape == (5, 12, 8) and rel_error(G5[1], G5[0]) > DISTINCT_REL
    torch.testing.assert_close(S.diagonal_fisher(G5), (G5 ** 2).mean(0), **FLOAT64)


def _abs_forward(model, x):
    """Scale and length of the float32 round-off of a Linear/LowRankLinear/ReLU stack (``linear_scale`` chained).

    ReLU is 1-Lipschitz and the identity on the non-negative scale, so the layers' scales compose.
    """
    h, length = x, 0
    for mod in model:
        if isinstance(mod, LowRankLinear):
            h, n = linear_scale(h, mod.first.weight, mod.second.weight, bias=mod.second.bias)
        elif isinstance(mod, torch.nn.Linear):
            h, n = linear_scale(h, mod.weight, bias=mod.bias)
        else:
            continue
        length += n
    return h, length


def _factors(low):
    """``(W_2, W_1)`` of the factorised first layer of ``low``."""
    return low[0].second.weight.detach(), low[0].first.weight.detach()


def test_full_rank_compression_keeps_the_model_and_low_rank_truncates():
    _, task, model = _trained()
    G = S.batch_gradients(model, 0, task.X_train, task.y_train, k=6, batch_size=16)
    res = S.kronecker_factors(G)
    n, m = model[0].weight.shape
    x = task.X_val
    for method in S.COMPARED:
        comp = S.compress_layer(model, 0, method, min(n, m), A=res.A, B=res.B, fisher_diag=S.diagonal_fisher(G))
        # the factors are float64 results rounded to float32: both outputs are one float32 forward pass
        scale, length = _abs_forward(comp, x)
        assert_close_f32(comp(x), model(x), length=length, scale=scale, what=f"{method} full-rank logits")
        low = S.compress_layer(model, 0, method, 2, A=res.A, B=res.B, fisher_diag=S.diagonal_fisher(G))
        W2, W1 = _factors(low)  # a float32 product of rank 2: singular values past 2 are round-off
        noise = float(float32_tol(abs_sum_scale(W2.T, W1), 2).norm())
        assert low[0].rank == 2 and int(torch.linalg.matrix_rank(low[0].weight.detach(), atol=noise, rtol=0)) == 2
    W = model[0].weight.detach().double()
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    low = S.compress_layer(model, 0, "svd", 3)
    W2, W1 = _factors(low)
    # float64 SVD in both; the layer's factors are rounded to float32 and multiplied (r = 3 terms)
    assert_close_f32(low[0].weight, U[:, :3] * s[:3] @ Vh[:3], length=3, scale=abs_sum_scale(W2.T, W1),
                     what="rank-3 SVD weight")
    eye = S.compress_layer(model, 0, "gfwsvd", 3, A=torch.eye(m, dtype=torch.float64),
                           B=torch.eye(n, dtype=torch.float64))
    assert_close_f32(eye[0].weight, low[0].weight, length=3, scale=abs_sum_scale(W2.T, W1),
                     what="GFWSVD(I, I) weight vs SVD weight")
    weighted = S.compress_layer(model, 0, "gfwsvd", 3, A=res.A, B=res.B)[0].weight
    assert rel_error(weighted, low[0].weight) > DISTINCT_REL
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
    assert 0 < df["fisher_share"].iloc[0] <= 1 + F64_REL
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
    assert math.isclose(fw.loc["toeplitz", "gap"], 0.1) and \
        math.isclose(fw.loc["isotropic", "gap"], 0.0, abs_tol=FLOAT64["atol"])
    assert math.isclose(fw.loc["anisotropic", "se"], 0.01, rel_tol=F64_REL)  # std 0.01*sqrt(2), over sqrt(2)
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
