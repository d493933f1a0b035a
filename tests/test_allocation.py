"""Rank allocation: predicted curves against dense float64 references, the budget, and compress(allocation=)."""
import copy
import itertools

import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.core.allocation import (choose_by_threshold, choose_ranks, max_profitable_rank, saving,
                                        truncation_errors)
from fisherkron.hf.allocation import allocate, fisher_curves
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.hf.sensitivity import sensitivity_sweep
from fisherkron.hf.surgery import compress, count_params
from fisherkron.testing import F64_REL, RELOAD
from tiny_models import tiny_llama, token_batches

SHAPES = [(7, 5), (5, 8), (6, 6)]


def _spd(d, g):
    X = torch.randn(d, d + 3, generator=g, dtype=torch.float64)
    return X @ X.T / d + 0.2 * torch.eye(d, dtype=torch.float64)


def _weights(kind, n, m, g):
    if kind == "none":
        return None, None
    if kind == "diag":
        return torch.rand(n, generator=g, dtype=torch.float64) + 0.5, torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    return torch.linalg.cholesky(_spd(n, g)), torch.linalg.cholesky(_spd(m, g))


@pytest.mark.parametrize("n,m", SHAPES)
@pytest.mark.parametrize("kind", ["none", "diag", "chol"])
def test_truncation_errors_equal_dense_reference_at_every_rank(n, m, kind):
    g = torch.Generator().manual_seed(3 * n + m)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    left, right = _weights(kind, n, m, g)
    A, B = _spd(m, g), _spd(n, g)  # the metric: another Kronecker Fisher
    got = truncation_errors(W, left, right, A, B)
    q = min(n, m)
    assert got.shape == (q + 1,)
    for r in range(1, q + 1):
        W2, W1 = fk.weighted_svd(W, r, left=left, right=right)
        dW = fk.vec(W - W2 @ W1)
        want = float(dW @ torch.kron(A, B) @ dW)  # Eq. (14) through the dense nm x nm product
        assert abs(float(got[r]) - want) <= F64_REL * max(float(got[0]), 1.0)
    dW0 = fk.vec(W)
    assert abs(float(got[0]) - float(dW0 @ torch.kron(A, B) @ dW0)) <= F64_REL * float(got[0])


@pytest.mark.parametrize("n,m", SHAPES)
def test_gfwsvd_curve_in_its_own_metric_is_theorem1_tail(n, m):
    g = torch.Generator().manual_seed(n * m)
    W, A, B = torch.randn(n, m, generator=g, dtype=torch.float64), _spd(m, g), _spd(n, g)
    LA, LB = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    s2 = torch.linalg.svdvals(LB.T @ W @ LA) ** 2
    want = torch.cat([s2.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
    torch.testing.assert_close(truncation_errors(W, LB, LA, A, B), want, rtol=F64_REL, atol=F64_REL * float(want[0]))


def _brute_force(curves, shapes, need):
    opts = {n: [None] + list(range(1, max_profitable_rank(*shapes[n]) + 1)) for n in curves}
    best = None
    for combo in itertools.product(*opts.values()):
        ch = dict(zip(opts, combo))
        if sum(saving(*shapes[n], r) for n, r in ch.items()) < need:
            continue
        err = sum(0.0 if r is None else float(curves[n][r]) for n, r in ch.items())
        if best is None or err < best[0]:
            best = (err, ch)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_choose_ranks_meets_the_budget_and_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (9, 7), "b": (8, 8), "c": (12, 5)}
    curves = {}
    for name, (n, m) in shapes.items():
        W = torch.randn(n, m, generator=g, dtype=torch.float64) * (1 + 3 * torch.rand(1, generator=g).item())
        curves[name] = truncation_errors(W)
    total = sum(n * m for n, m in shapes.values())
    for frac in (0.1, 0.3, 0.5):
        need = int(frac * total)
        ch = choose_ranks(curves, shapes, need)
        removed = sum(saving(*shapes[n], r) for n, r in ch.items())
        assert removed >= need
        err = sum(0.0 if r is None else float(curves[n][r]) for n, r in ch.items())
        opt, _ = _brute_force(curves, shapes, need)
        assert err <= opt * (1 + 0.15) + 1e-12, (frac, ch)  # Lagrangian + greedy: near the discrete optimum


def test_choose_ranks_compresses_the_insensitive_layer_first():
    shapes = {"flat": (8, 8), "steep": (8, 8)}
    r = np.arange(9, dtype=np.float64)
    curves = {"flat": 1e-6 * (8 - r), "steep": 1.0 * (8 - r) ** 2}
    ch = choose_ranks(curves, shapes, need=20)
    assert ch["flat"] == 2 and ch["steep"] is None  # rank 2 saves 32 >= 20; the steep layer stays dense
    with pytest.raises(fk.FisherkronError, match="rank 1 everywhere"):
        choose_ranks(curves, shapes, need=10_000)


def test_choose_by_threshold_is_asvd_threshold_search():
    shapes = {"x": (10, 10), "y": (10, 10)}
    sens = {"x": {4: 0.01, 2: 0.05, 1: 0.3}, "y": {4: 0.2, 2: 0.4, 1: 0.9}}
    ch, tau = choose_by_threshold(sens, shapes, need=saving(10, 10, 2) + saving(10, 10, 4))
    assert ch == {"x": 2, "y": 4} and tau == 0.2
    ch, tau = choose_by_threshold(sens, shapes, need=1)
    assert ch == {"x": 4, "y": None} and tau == 0.01


# ---------------------------------------------------------------------------- model level
def _batches(k=4, seed=0, B=2, T=10):
    return token_batches(k=k, seed=seed, B=B, T=T)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    st = collect_calibration(model, _batches(), None, cache_dir=tmp_path_factory.mktemp("cal"))
    return model, st


@pytest.mark.parametrize("strategy", ["uniform", "fisher", "sensitivity"])
@pytest.mark.parametrize("method", ["gfwsvd", "svd_llm", "kfac_svd"])
def test_compress_with_allocation_meets_the_ratio(strategy, method, calibrated, tmp_path):
    base, st = calibrated
    model = copy.deepcopy(base)
    opts = ({"heldout": _batches(k=2, seed=9), "cache_dir": tmp_path, "sensitivity_ratios": (0.2, 0.5, 0.8)}
            if strategy == "sensitivity" else None)
    rep = compress(model, method, st, ratio=0.15, allocation=strategy, allocation_options=opts,
                   mff_options=dict(max_matvecs=60))
    assert rep.allocation == strategy
    assert rep.ratio >= 0.15
    if strategy == "fisher":  # the knapsack meets the budget to within one rank step of one layer
        step = max(lr.n + lr.m for lr in rep.layers.values())
        assert rep.ratio < 0.15 + step / rep.params_before
    dense = [n for n, lr in rep.layers.items() if lr.skipped]
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in dense)
    assert count_params(model) == rep.params_after
    out = save_compressed(model, tmp_path / "m")
    x = _batches(k=1)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(load_compressed(out)(x).logits, model(x).logits, **RELOAD)


def test_fisher_curves_of_gfwsvd_are_theorem1_tails_of_its_factors(calibrated):
    """With no regularisation floor the GFWSVD curve in MFF's metric is exactly Theorem 1's tail."""
    base, st = calibrated
    names = list(st.layers)[:3]
    curves, metric = fisher_curves(base, "gfwsvd", st, names, min_alpha=0, mff_options=dict(max_matvecs=60))
    assert metric == "mff"
    for n in names:
        f = st.kronecker(n, max_matvecs=60)
        rA, rB = fk.regularize(f["A"], min_alpha=0), fk.regularize(f["B"], min_alpha=0)
        assert rA.alpha == 0 and rB.alpha == 0  # positive definite: the metric is the factors themselves
        W = base.get_submodule(n).weight.detach().double()
        s2 = torch.linalg.svdvals(rB.L.T @ W @ rA.L) ** 2
        tails = 0.5 * torch.cat([s2.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
        assert float((curves[n] - tails).abs().max()) <= F64_REL * float(tails[0])


def test_fisher_allocation_beats_uniform_in_predicted_loss(calibrated):
    base, st = calibrated
    names = list(st.layers)
    uni = allocate(base, "gfwsvd", st, names, ratio=0.2, strategy="uniform")
    fis = allocate(base, "gfwsvd", st, names, ratio=0.2, strategy="fisher", mff_options=dict(max_matvecs=60))
    curves, _ = fisher_curves(base, "gfwsvd", st, names, mff_options=dict(max_matvecs=60))
    pred = {a.strategy: sum(0.0 if r is None else float(curves[n][r]) for n, r in a.ranks.items())
            for a in (uni, fis)}
    assert pred["fisher"] <= pred["uniform"]
    assert fis.ratio >= 0.2 and fis.evaluations == 0


def test_sensitivity_sweep_is_cached_and_invalidated(calibrated, tmp_path):
    base, st = calibrated
    names = list(st.layers)[:2]
    held = _batches(k=2, seed=5)
    one = sensitivity_sweep(base, "svd", st, names, held, ratios=(0.3, 0.6), cache_dir=tmp_path)
    assert not one["from_cache"] and one["evaluations"] == 1 + 2 * 2
    two = sensitivity_sweep(base, "svd", st, names, held, ratios=(0.3, 0.6), cache_dir=tmp_path)
    assert two["from_cache"] and two["table"] == one["table"]
    other = sensitivity_sweep(base, "svd", st, names, _batches(k=2, seed=6), ratios=(0.3, 0.6), cache_dir=tmp_path)
    assert not other["from_cache"]  # other held-out data
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.get_submodule(names[0]).weight.mul_(1.5)
    assert not sensitivity_sweep(changed, "svd", None, names, held, ratios=(0.3, 0.6),
                                 cache_dir=tmp_path)["from_cache"]  # other weights
    # the model is left exactly as it was
    for n in names:
        assert isinstance(base.get_submodule(n), torch.nn.Linear)


def test_allocation_errors_are_one_line(calibrated):
    base, st = calibrated
    with pytest.raises(fk.FisherkronError, match="allocation 'greedy' is unknown"):
        compress(copy.deepcopy(base), "svd", None, ratio=0.1, allocation="greedy")
    with pytest.raises(fk.FisherkronError, match="held-out"):
        compress(copy.deepcopy(base), "svd", None, ratio=0.1, allocation="sensitivity")
    with pytest.raises(fk.FisherkronError, match="do not give rank"):
        compress(copy.deepcopy(base), "svd", None, rank=2, allocation="fisher")


@pytest.mark.parametrize("kind", ["none", "diag", "chol"])
@pytest.mark.parametrize("n,m", SHAPES)
def test_decomposition_slices_equal_dense_reference_factors(n, m, kind):
    """One full weighted SVD, sliced at rank r, is Eq. (7) at rank r (dense float64 reference)."""
    from fisherkron.core.wsvd import decompose

    g = torch.Generator().manual_seed(5 * n + m)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    left, right = _weights(kind, n, m, g)
    LB = torch.eye(n, dtype=torch.float64) if left is None else (torch.diag(left) if left.ndim == 1 else left)
    LA = torch.eye(m, dtype=torch.float64) if right is None else (torch.diag(right) if right.ndim == 1 else right)
    U, S, Vh = torch.linalg.svd(LB.T @ W @ LA)
    dec = decompose(W, left, right)
    for r in range(1, min(n, m) + 1):
        want = torch.linalg.inv(LB.T) @ (U[:, :r] * S[:r]) @ Vh[:r] @ torch.linalg.inv(LA)  # Eq. (7), dense
        W2, W1 = dec.factors(r)
        torch.testing.assert_close(W2 @ W1, want, rtol=F64_REL, atol=F64_REL * float(W.abs().max()))


def test_decompositions_cache_reuses_and_never_serves_stale(calibrated):
    from fisherkron.hf.allocation import Decompositions

    base, st = calibrated
    names = list(st.layers)
    cache = Decompositions()
    a = copy.deepcopy(base)
    ra = compress(a, "gfwsvd", st, ratio=0.2, allocation="fisher", decompositions=cache)
    assert cache.misses == len(names) and len(cache) == len(names)
    b = copy.deepcopy(base)
    rb = compress(b, "gfwsvd", st, ratio=0.2, allocation="fisher", decompositions=cache)
    assert cache.misses == len(names)  # curves and factors all from the cache
    fresh = copy.deepcopy(base)
    compress(fresh, "gfwsvd", st, ratio=0.2, allocation="fisher")
    assert ra.ranks == rb.ranks
    for (pa, pb), pf in zip(zip(a.parameters(), b.parameters()), fresh.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pf)
    # another option is another entry; a changed weight is recomputed, not served
    cache.get(base.get_submodule(names[0]), "gfwsvd", st, names[0], min_alpha=0.1)
    assert cache.misses == len(names) + 1
    lin = copy.deepcopy(base.get_submodule(names[0]))
    dec0, _ = cache.get(lin, "gfwsvd", st, names[0])
    with torch.no_grad():
        lin.weight.mul_(2.0)
    dec1, _ = cache.get(lin, "gfwsvd", st, names[0])
    assert cache.misses == len(names) + 2
    assert not torch.allclose(dec0.S, dec1.S)


def test_prefix_replay_gives_the_losses_of_whole_evaluations_and_skips_earlier_blocks(calibrated):
    """Replaying the recorded outputs of the blocks before a layer's changes no loss, only the cost."""
    from fisherkron.hf.sensitivity import PrefixReplay, loss_with_factors, mean_loss

    base, st = calibrated
    base.eval()
    names = list(st.layers)
    held = _batches(k=2, seed=7)
    replay = PrefixReplay(base, names, held)
    assert replay.enabled
    assert replay.base == pytest.approx(mean_loss(base, held), rel=1e-12)
    blocks = base.get_submodule(replay.path)
    calls = []
    hook = blocks[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        for name in (names[0], names[-1]):
            W = base.get_submodule(name).weight.detach()
            f = fk.svd(W, 2)
            calls.clear()
            fast = loss_with_factors(base, name, f, held, replay=replay)
            ran_first_block = bool(calls)
            slow = loss_with_factors(base, name, f, held)
            assert fast == pytest.approx(slow, rel=1e-6), name
            assert ran_first_block == (replay.index[name] == 0)
    finally:
        hook.remove()
    assert mean_loss(base, held) == pytest.approx(replay.base, rel=1e-12)  # the model is as it was


def test_prefix_replay_switches_itself_off_where_it_cannot_hold():
    from fisherkron.hf.sensitivity import PrefixReplay

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    batches = [torch.randn(5, 4)]
    replay = PrefixReplay(model, ["0", "2"], batches, loss_fn=lambda mdl, b: mdl(b).pow(2).mean())
    assert not replay.enabled  # no list of blocks: whole evaluations
    with torch.no_grad():
        want = float(model(batches[0]).pow(2).mean())
    assert replay.loss(model, "2") == pytest.approx(want)


def test_rank_allocation_study_takes_the_mff_dtype_by_name():
    """The notebook's ``mff_dtype`` reaches MFF as a torch dtype; an unknown one fails before the model loads."""
    from fisherkron.experiments import rank_allocation

    assert rank_allocation._mff_options({"tol": 1e-4, "dtype": "float64"}) == {"tol": 1e-4, "dtype": torch.float64}
    assert rank_allocation._mff_options(None) == {}
    with pytest.raises(ValueError, match="MFF computes in float32 or float64"):
        rank_allocation.prepare("no-such-model", mff_options={"dtype": "float16"})
