"""Learned truncation (Dobi-SVD's trainable positions on a weighted SVD) on tiny random Llama decoders."""
import copy
import math
import types

import pytest
import torch
from torch import nn

from fisherkron.core.allocation import max_profitable_rank, saving
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.core.wsvd import decompose
from fisherkron.hf.allocation import Decompositions
from fisherkron.hf.budget import count_params
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.hf.truncation import (SoftTruncatedLinear, budget_ranks, budget_term, learn_truncation, lm_term,
                                      train_truncation)
from fisherkron.testing import FLOAT64, RELOAD
from tiny_models import tiny_llama

#: how far the mask is from a hard 0/1 at half a rank from the position: 0.5 (1 - tanh(beta / 2)), beta = 10
MASK_TAIL = 0.5 * (1 - math.tanh(5.0))
#: central differences of a float64 loss with h = 1e-5: truncation error ~h^2 beta^2 / 6 ~ 2e-9 of the
#: gradient, round-off ~1e-11 (measured 4e-9); a gradient off by a factor or a sign is off by O(1)
FD_REL = 1e-6
METHODS = ("svd", "svd_llm", "kfac_svd", "gfwsvd")


def batches(k=4, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, 97, (B, T), generator=g)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    stats = collect_calibration(model, batches(), None, methods=METHODS, cache_dir=tmp_path_factory.mktemp("cal"))
    return model, stats


def tight(ranks, shapes, need):
    """Removed >= need, and no layer can take one rank more without breaking the budget."""
    removed = sum(saving(*shapes[n], r) for n, r in ranks.items())
    assert removed >= need
    for n, r in ranks.items():
        if r is None:
            continue
        more = saving(*shapes[n], r + 1) if r + 1 <= max_profitable_rank(*shapes[n]) else 0
        assert removed - saving(*shapes[n], r) + more < need, f"{n} could take rank {r + 1}"
    return removed


def tail_bound(x, dec) -> float:
    """How far the soft layer at gamma = r - 1/2 can be from its hard 0/1 mask: every mask entry is within
    MASK_TAIL of it, so the output within MASK_TAIL * sum|x Q| * max s * max|P| (twice, for slack)."""
    return MASK_TAIL * float((x @ dec.Q).abs().sum() * dec.S.max() * dec.P.abs().max()) * 2


def rms_norm_f64(self, x):
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


# ----------------------------------------------------------------------------- the soft layer

def test_soft_layer_at_half_integer_position_is_the_rank_r_factorisation():
    """gamma = r - 1/2 gives Eq. (7)'s W_2 W_1 up to the mask's tail (r <= r_max); a position above q gives W."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(7, 5, generator=g, dtype=torch.float64)
    LB = torch.linalg.cholesky(torch.eye(7, dtype=torch.float64) + 0.3 * torch.ones(7, 7, dtype=torch.float64))
    LA = torch.tril(torch.rand(5, 5, generator=g, dtype=torch.float64)) + torch.eye(5, dtype=torch.float64)
    dec = decompose(W, LB, LA)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    for r in range(1, max_profitable_rank(7, 5) + 1):  # above r_max (2) the layer is W: the test below
        soft = SoftTruncatedLinear(dec.P, dec.S, dec.Q, None, r - 0.5, gamma_dtype=torch.float64)
        W2, W1 = dec.factors(r)
        ref = x @ (W2 @ W1).T  # (3, 7)
        # |mu_i - [i < r]| <= MASK_TAIL for every i (the nearest singular values are half a rank away)
        bound = tail_bound(x, dec)
        assert float((soft(x) - ref).detach().abs().max()) <= bound
        assert abs(float(soft.soft_rank().detach()) - r) <= 5 * MASK_TAIL
    full = SoftTruncatedLinear(dec.P, dec.S, dec.Q, None, 40.0, gamma_dtype=torch.float64)
    torch.testing.assert_close(full(x), x @ W.T, **FLOAT64)


def test_the_windowed_forward_equals_the_dense_soft_weight():
    """Skipping the triplets far above the position changes nothing at float64 round-off (a 41 x 30 layer)."""
    g = torch.Generator().manual_seed(2)
    W = torch.randn(41, 30, generator=g, dtype=torch.float64)
    dec = decompose(W, None, torch.rand(30, generator=g, dtype=torch.float64) + 0.5)
    x = torch.randn(3, 30, generator=g, dtype=torch.float64)
    assert max_profitable_rank(41, 30) == 17
    for gamma in (-0.7, 4.2, 14.6, 16.9, 17.5, 29.9):  # 14.6 and on: the dense gate's window, all triplets
        soft = SoftTruncatedLinear(dec.P, dec.S, dec.Q, None, gamma, gamma_dtype=torch.float64)
        mu = 0.5 * torch.tanh(10 * (gamma - torch.arange(30, dtype=torch.float64))) + 0.5  # (q,)
        sigma = 0.5 * math.tanh(10 * (gamma - 17)) + 0.5
        nu = mu + sigma * (1 - mu)
        ref = x @ (dec.P @ torch.diag(dec.S * nu) @ dec.Q.T).T  # (3, 41)
        torch.testing.assert_close(soft(x).detach(), ref, **FLOAT64)


def test_the_soft_layer_is_the_layer_that_budget_ranks_materialises():
    """At gamma = r - 1/2 the soft layer is what materialising rank round(k) gives: the rank-r factors up to
    r_max, the dense W above it (budget_ranks keeps such a layer dense). Without the dense gate, r_max < r < q
    truncated a layer the budget keeps dense: on this 41 x 30 layer (r_max = 17) an output error of 1.4-2.9 at
    r = 18..29 (the discarded singular values), where the gated layer is within the mask's tail (<= 2e-4, bound
    4e-2)."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(41, 30, generator=g, dtype=torch.float64)
    dec = decompose(W, None, torch.rand(30, generator=g, dtype=torch.float64) + 0.5)
    x = torch.randn(3, 30, generator=g, dtype=torch.float64)
    shapes = {"l": (41, 30)}
    for r in (1, 9, 16, 17, 18, 20, 29, 30):
        soft = SoftTruncatedLinear(dec.P, dec.S, dec.Q, None, r - 0.5, gamma_dtype=torch.float64)
        k = float(soft.soft_rank().detach())
        need = saving(41, 30, round(k)) if round(k) <= 17 else 0  # exactly what round(k) removes
        hard = budget_ranks({"l": k}, shapes, need=need)["l"]  # so: round(k), or dense above r_max
        assert hard == (r if r <= 17 else None)
        weight = W if hard is None else torch.mm(*dec.factors(hard))  # (41, 30)
        ref = x @ weight.T
        bound = tail_bound(x, dec)
        assert float((soft(x).detach() - ref).abs().max()) <= bound, r
        if 17 < r < 30:  # what the ungated mask gave: the rank-r truncation, far from the dense layer
            mu = soft.mask().detach()
            ungated = x @ (dec.P @ torch.diag(dec.S * mu) @ dec.Q.T).T
            assert float((ungated - ref).abs().max()) > 10 * bound, r


def test_gradient_wrt_each_position_matches_finite_differences(calibrated):
    """d(exp(NLL) + lam |rho - target| + guard) / d gamma_l against central differences, float64."""
    model = copy.deepcopy(calibrated[0]).double()
    for mod in model.modules():  # LlamaRMSNorm computes in float32 whatever the weights; keep float64
        if type(mod).__name__ == "LlamaRMSNorm":
            mod.forward = types.MethodType(rms_norm_f64, mod)
    stats = calibrated[1]
    names = list(stats.layers)
    mods = dict(model.named_modules())
    total = count_params(model)
    g = torch.Generator().manual_seed(1)
    soft = {}
    for i, n in enumerate(names):
        dec = Decompositions().get(mods[n], "svd_llm", stats, n)[0]
        q = min(dec.shape)
        gamma = q + 0.7 if i == 3 else (q // 3) - 0.5 + 0.6 * float(torch.rand(1, generator=g)) - 0.3
        soft[n] = SoftTruncatedLinear(dec.P, dec.S, dec.Q, None, gamma, gamma_dtype=torch.float64)
        model.set_submodule(n, soft[n])
    model.requires_grad_(False)
    for mod in soft.values():
        mod.gamma.requires_grad_(True)
    batch = batches(1)[0]
    target = 0.6  # far from rho(gamma) ~ 0.3: |rho - target| is smooth here

    def nll(model, b):  # transformers' loss casts the logits to float32; this keeps float64
        logits = model(input_ids=b["input_ids"]).logits  # (B, T, V)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), b["labels"][:, 1:].reshape(-1))

    def loss():
        return lm_term(model, batch, "perplexity", nll) + budget_term(soft, total, target, 200.0)[0]

    for mod in soft.values():  # away from the kinks of max(0, n m - k (n + m)) and of the guard
        k = float(mod.soft_rank().detach())
        assert abs(mod.out_features * mod.in_features - k * (mod.out_features + mod.in_features)) > 1.0
    loss().backward()
    grad = torch.stack([soft[n].gamma.grad for n in names])
    h = 1e-5
    fd = []
    with torch.no_grad():
        for n in names:
            soft[n].gamma += h
            up = float(loss())
            soft[n].gamma -= 2 * h
            down = float(loss())
            soft[n].gamma += h
            fd.append((up - down) / (2 * h))
    fd = torch.tensor(fd, dtype=torch.float64)
    assert float(grad.abs().min()) > 0  # every position matters (the guard for the one above q)
    assert float((grad - fd).abs().max()) <= FD_REL * float(grad.abs().max())


# ----------------------------------------------------------------------------- ranks under the budget

def test_budget_ranks_meet_the_budget_by_less_than_one_step():
    g = torch.Generator().manual_seed(0)
    shapes = {f"l{i}": (int(torch.randint(5, 40, (1,), generator=g)), int(torch.randint(5, 40, (1,), generator=g)))
              for i in range(9)}
    total = sum(n * m for n, m in shapes.values())
    for trial in range(20):
        soft = {n: float(torch.rand(1, generator=g)) * min(s) for n, s in shapes.items()}
        need = int(total * (0.1 + 0.05 * (trial % 10)))
        ranks = budget_ranks(soft, shapes, need)
        tight(ranks, shapes, need)
        for n, r in ranks.items():
            assert r is None or 1 <= r <= max_profitable_rank(*shapes[n])
    with pytest.raises(FisherkronError, match="out of reach"):
        budget_ranks({"a": 3.0}, {"a": (8, 6)}, need=35)


# ----------------------------------------------------------------------------- training and materialising

@pytest.mark.parametrize("method", METHODS)
def test_learned_ranks_meet_the_budget_and_the_layers_are_the_decomposition_factors(calibrated, method):
    model, stats = copy.deepcopy(calibrated[0]), calibrated[1]
    before = dict(model.named_modules())
    total = count_params(model)
    decs = Decompositions()
    report = learn_truncation(model, method, stats, batches(), ratio=0.3, steps=3, decompositions=decs)
    assert report.need == math.ceil(0.3 * total)
    removed = tight(report.ranks, report.shapes, report.need)
    assert count_params(model) == total - removed
    assert report.compression.params_before - report.compression.params_after == removed
    assert report.compression.ratio >= 0.3 and report.ratio >= 0.3
    assert len(report.history) == 3 and report.steps == 3
    after = dict(model.named_modules())
    for n, r in report.ranks.items():
        if r is None:
            assert after[n] is before[n]
            continue
        W2, W1 = decs.get(before[n], method, stats, n)[0].factors(r)
        assert isinstance(after[n], LowRankLinear) and after[n].rank == r
        assert torch.equal(after[n].first.weight, W1) and torch.equal(after[n].second.weight, W2)


def test_training_changes_no_weight_and_restores_the_model(calibrated):
    model, stats = copy.deepcopy(calibrated[0]), calibrated[1]
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    modules = dict(model.named_modules())
    report = train_truncation(model, "svd_llm", stats, batches(), ratio=0.3, steps=4)
    assert {k: v for k, v in model.state_dict().items()}.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags and model.training
    assert all(m is modules[n] for n, m in model.named_modules())
    moved = [n for n, r in report.init_ranks.items() if report.gammas[n] != pytest.approx(r - 0.5, abs=1e-3)]
    assert moved  # not vacuous: the positions were trained


def test_keep_best_returns_the_positions_of_the_lowest_loss(calibrated):
    """With one step, the only loss seen is that of the initial positions: keep="best" returns them."""
    model, stats = copy.deepcopy(calibrated[0]), calibrated[1]
    best = train_truncation(model, "svd", None, batches(), ratio=0.3, steps=1, keep="best", layers=list(stats.layers))
    final = train_truncation(model, "svd", None, batches(), ratio=0.3, steps=1, layers=list(stats.layers))
    assert all(best.gammas[n] == pytest.approx(r - 0.5, abs=1e-6) for n, r in best.init_ranks.items())
    assert best.gammas != final.gammas


def test_a_resumed_run_equals_the_uninterrupted_one(calibrated, tmp_path):
    model, stats = copy.deepcopy(calibrated[0]), calibrated[1]
    options = dict(ratio=0.3, steps=6, accumulate=3, checkpoint_every=4)  # micro-batches cross epochs
    whole = train_truncation(model, "svd_llm", stats, batches(), **options)

    def stop(step, record):
        if step == 3:
            raise KeyboardInterrupt

    ckpt = tmp_path / "truncation.pt"
    with pytest.raises(KeyboardInterrupt):
        train_truncation(model, "svd_llm", stats, batches(), checkpoint=ckpt, callback=stop, **options)
    assert all(not isinstance(m, SoftTruncatedLinear) for m in model.modules())
    resumed = train_truncation(model, "svd_llm", stats, batches(), checkpoint=ckpt, **options)
    assert resumed.resumed_at == 3
    assert resumed.gammas == whole.gammas and resumed.history == whole.history and resumed.ranks == whole.ranks
    again = train_truncation(model, "svd_llm", stats, batches(), checkpoint=ckpt, **options)  # finished: no training
    assert again.resumed_at == 6 and again.gammas == whole.gammas
    with pytest.raises(FisherkronError, match="another learned-truncation run"):
        train_truncation(model, "svd_llm", stats, batches(), checkpoint=ckpt, lam=100.0, **options)


def test_the_result_is_saved_and_reloaded(calibrated, tmp_path):
    model, stats = copy.deepcopy(calibrated[0]), calibrated[1]
    report = learn_truncation(model, "svd_llm", stats, batches(), ratio=0.3, steps=2)
    out = save_compressed(model, tmp_path / "dobi", report=report.compression)
    loaded = load_compressed(out)
    x = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, model(**x).logits, **RELOAD)
    assert {n: m.rank for n, m in loaded.named_modules() if isinstance(m, LowRankLinear)} == \
        {n: r for n, r in report.ranks.items() if r is not None}
    assert not any(isinstance(m, nn.Linear) and n in report.ranks and report.ranks[n] is not None
                   for n, m in loaded.named_modules())


def test_bad_arguments_are_one_line_errors(calibrated):
    model, stats = calibrated
    with pytest.raises(FisherkronError, match="lm_loss"):
        train_truncation(model, "svd_llm", stats, batches(), ratio=0.3, steps=1, lm_loss="ppl")
    with pytest.raises(FisherkronError, match="ratio"):
        train_truncation(model, "svd_llm", stats, batches(), ratio=30, steps=1)
