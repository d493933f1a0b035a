"""Basis Sharing (Wang et al. 2024) against dense float64 references and on tiny random Llama decoders."""
import copy

import pytest
import torch

from fisherkron.core.basis_sharing import SharedBasisLinear, shared_basis, shared_basis_rank
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import rank_for_ratio
from fisherkron.core.wsvd import svd_llm
from fisherkron.hf.basis_sharing import PROJECTIONS, compress_basis_sharing, plan_basis_sharing
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.surgery import compress, count_params
from fisherkron.testing import F64_REL, FLOAT64
from tiny_models import tiny_bert, token_batches

#: a whole model whose every stacked weight has rank <= r is reproduced up to float32 round-off of
#: 28 factorised layers: measured 1.6e-7 of max |logit|; a wrong split or basis is O(1)
EXACT_MODEL_REL = 1e-4


def tiny_decoder(seed=0, layers=4, kv_heads=2):
    """A random Llama with GQA (4 query heads, 2 key/value heads): q, o 48 x 48; k, v 24 x 48; up, gate 72 x 48."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def batches(k=4, B=2, T=9, seed=0):
    return token_batches(k=k, B=B, T=T, seed=seed)


def calibrate(model, tmp_path, stats=("xxt",)):
    return collect_calibration(model, batches(), None, stats=stats, cache_dir=tmp_path)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    model = tiny_decoder()
    return model, calibrate(model, tmp_path_factory.mktemp("cal"))


def group_problem(ns=(7, 9), m=6, tokens=4, seed=0):
    """Two layers (7 x 6, 9 x 6) whose own Grams are singular (4 tokens each) while their sum is definite."""
    g = torch.Generator().manual_seed(seed)
    Ws = [torch.randn(n, m, generator=g, dtype=torch.float64) for n in ns]
    Xs = [torch.randn(m, tokens, generator=g, dtype=torch.float64) for _ in ns]  # (m, T_j): layer j's inputs
    return Ws, [X @ X.T for X in Xs]


# ----------------------------------------------------------------------------- one group (core)

def test_group_error_equals_the_discarded_singular_values_of_the_stacked_whitened_matrix():
    """sum_j ||(W_j - W2_j W1) S||_F^2 = sum_{i>r} sigma_i^2 with W_s S = U Sigma V^T, S S^T = sum_j X_j X_j^T."""
    Ws, grams = group_problem()
    M = grams[0] + grams[1]  # (6, 6): definite, the layers' own Grams (rank 4) are not
    S = torch.linalg.cholesky(M)  # reference whitening, independent of fisherkron's regularisation
    U, s, Vh = torch.linalg.svd(torch.cat(Ws) @ S, full_matrices=False)  # (16, 6), (6,), (6, 6)
    total = float((s ** 2).sum())
    for r in range(1, 7):
        W1, W2s = shared_basis(Ws, M, r, min_alpha=0)
        assert W1.shape == (r, 6) and [W.shape for W in W2s] == [(7, r), (9, r)]
        err = sum(float(((W - W2 @ W1) @ S).square().sum()) for W, W2 in zip(Ws, W2s))
        assert abs(err - float((s[r:] ** 2).sum())) <= F64_REL * total
        # the dense reference: the stacked rank-r truncation, unwhitened, split by layer
        ref = (U[:, :r] * s[:r]) @ Vh[:r] @ torch.linalg.inv(S)  # (16, 6)
        torch.testing.assert_close(torch.cat([W2 @ W1 for W2 in W2s]), ref, **FLOAT64)


def test_the_summed_gram_is_regularised_as_svd_llm_regularises_one():
    """Default floor: S S^T = M + alpha diag(M) of the summed M, alpha = MIN_ALPHA reported."""
    Ws, grams = group_problem(seed=1)
    M = grams[0] + grams[1]
    f = shared_basis(Ws, M, 3)
    assert f.alpha == pytest.approx(1e-3)
    S = torch.linalg.cholesky(M + f.alpha * torch.diag(torch.diagonal(M)))
    s = torch.linalg.svdvals(torch.cat(Ws) @ S)
    err = sum(float(((W - W2 @ f.W1) @ S).square().sum()) for W, W2 in zip(Ws, f.W2s))
    assert abs(err - float((s[3:] ** 2).sum())) <= F64_REL * float((s ** 2).sum())


def test_a_group_of_one_is_svd_llm():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(7, 5, generator=g, dtype=torch.float64)
    X = torch.randn(5, 3, generator=g, dtype=torch.float64)  # 3 tokens: a singular Gram, regularised
    for r in range(1, 6):
        W1, (W2,) = f = shared_basis([W], X @ X.T, r)
        ref = svd_llm(W, X @ X.T, r)
        torch.testing.assert_close(W1, ref.W1, **FLOAT64)
        torch.testing.assert_close(W2, ref.W2, **FLOAT64)
        assert f.alpha == ref.alpha_A


def test_rank_formula_is_the_authors():
    """r = floor(m n g (1 - rho) / (m + n g)): the authors' compute_num_basis on Llama-2-7B at 20 %."""
    assert shared_basis_rank(4096, 4096, 0.2, group=2) == 2184  # q: 4096*4096*2*0.8 / 12288 = 2184.5
    assert shared_basis_rank(11008, 4096, 0.2, group=2) == 2762  # up, gate: / 26112 = 2762.8
    assert shared_basis_rank(4096, 4096, 0.2) == 1638  # o (private): / 8192 = 1638.4
    assert shared_basis_rank(4096, 11008, 0.2) == 2388  # down (private): / 15104 = 2388.2
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        n, m, grp = (int(x) for x in torch.randint(1, 300, (3,), generator=g))
        grp = 1 + grp % 4
        rho = float(torch.rand((), generator=g)) * 0.99
        r = shared_basis_rank(n, m, rho, group=grp)
        budget = (1 - rho) * grp * n * m
        assert r == 1 or r * (m + grp * n) <= budget < (r + 1) * (m + grp * n)  # the largest rank within budget
        if grp == 1:
            assert r == rank_for_ratio(n, m, rho)  # a private layer: the uniform per-layer rank of compress
    with pytest.raises(FisherkronError, match="ratio must be in"):
        shared_basis_rank(10, 10, 1.0)


def test_shared_basis_linear_is_w2_w1_plus_bias_with_one_first():
    g = torch.Generator().manual_seed(4)
    W1 = torch.randn(3, 5, generator=g, dtype=torch.float64)
    W2s = [torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)]
    bs = [torch.randn(7, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)]
    a, b = SharedBasisLinear.from_factors(W1, W2s, bs)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    for mod, W2, bias in zip((a, b), W2s, bs):
        torch.testing.assert_close(mod(x), x @ (W2 @ W1).T + bias, **FLOAT64)
        torch.testing.assert_close(mod.weight, W2 @ W1, **FLOAT64)
    assert a.first is b.first and (a.rank, a.in_features, a.out_features, b.out_features) == (3, 5, 7, 2)
    assert "shared" in repr(a)
    both = torch.nn.ModuleList([a, b])
    assert sum(p.numel() for p in both.parameters()) == 3 * 5 + 3 * (7 + 2) + 7 + 2  # the basis once


# ----------------------------------------------------------------------------- a tiny decoder (hf)

@pytest.mark.parametrize("ratio", [0.1, 0.25])
def test_whole_model_budget_is_met_with_the_smallest_rho(decoder, ratio):
    base, st = decoder
    model = copy.deepcopy(base)
    before = count_params(model)
    rep = compress_basis_sharing(model, st, ratio)
    assert rep.params_before == before and rep.params_after == count_params(model)
    assert rep.ratio >= ratio and rep.ratio == pytest.approx(1 - count_params(model) / before)
    # the smallest rho: just below it the budget is missed
    assert plan_basis_sharing(base, rho=rep.rho - 1e-9).ratio < ratio
    # ranks: the authors' formula, g = 2 for the shared q, up, gate; g = 1 for k, v, o, down
    shape = {"q": (48, 48), "k": (24, 48), "v": (24, 48), "o": (48, 48), "gate": (72, 48), "up": (72, 48),
             "down": (48, 72)}
    for t, (n, m) in shape.items():
        assert rep.ranks[t] == shared_basis_rank(n, m, rep.rho, group=2 if t in ("q", "up", "gate") else 1)
    # the linear layers' counts, from the modules: each shared basis once
    lows = [mod for name, mod in model.named_modules() if isinstance(mod, SharedBasisLinear)]
    assert len(lows) == 28
    firsts = {id(mod.first): mod.first.weight.numel() for mod in lows}
    assert rep.layer_params_after == sum(firsts.values()) + sum(mod.second.weight.numel() for mod in lows)
    assert rep.layer_params_before == 4 * (2 * 48 * 48 + 2 * 24 * 48 + 3 * 72 * 48)
    assert rep.layers_ratio > rep.ratio  # the embeddings are not compressed
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, never compressed


def test_each_group_holds_one_basis_counted_once(decoder):
    base, st = decoder
    model = copy.deepcopy(base)
    rep = compress_basis_sharing(model, st, 0.2)
    blocks = model.model.layers
    for t in ("q", "up", "gate"):
        proj = PROJECTIONS[t]
        first = [blocks[i].get_submodule(proj).first for i in range(4)]
        assert first[0] is first[1] and first[2] is first[3] and first[0] is not first[2]
    for t in ("k", "v", "o", "down"):
        proj = PROJECTIONS[t]
        assert len({id(blocks[i].get_submodule(proj).first) for i in range(4)}) == 4
    once = sum(p.numel() for _, p in model.named_parameters())
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert once == count_params(model) == rep.params_after
    dup = sum(g["rank"] * 48 * (len(g["layers"]) - 1) for g in rep.groups)  # m = 48 for q, up, gate
    assert every - once == dup + model.lm_head.weight.numel() and dup > 0  # + the tied lm_head


def test_exact_when_every_stacked_weight_has_the_planned_rank(tmp_path):
    """Project each group's stacked weights onto rank r: the compressed model then reproduces the dense one."""
    model = tiny_decoder(seed=5)
    plan = plan_basis_sharing(model, ratio=0.25)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for g in plan.groups:
            Ws = torch.cat([mods[n].weight for n in g.names]).double()  # (sum n_j, m)
            Vr = torch.linalg.svd(Ws, full_matrices=False)[2][:g.rank]  # (r, m)
            for n, W in zip(g.names, torch.split(Ws @ Vr.T @ Vr, g.ns)):
                mods[n].weight.copy_(W)
    dense = copy.deepcopy(model)
    st = calibrate(model, tmp_path)
    rep = compress_basis_sharing(model, st, 0.25)
    assert rep.rho == plan.rho
    x = batches(k=1, seed=1)[0]["input_ids"]
    with torch.no_grad():
        ref, got = dense(x).logits, model(x).logits
    assert torch.isfinite(got).all()
    assert float((got - ref).abs().max() / ref.abs().max()) <= EXACT_MODEL_REL


def test_each_group_is_whitened_by_its_own_blocks_summed_gram(decoder):
    """On the model: sum_j ||(W_j - W2_j W1) S||^2 = sum_{i>r} sigma_i^2 of W_s S, with S S^T the summed Gram of
    the group's inputs captured here by plain hooks (min_alpha=0: no regularisation)."""
    base, st = decoder
    mods = dict(base.named_modules())
    names = [n for g in plan_basis_sharing(base, rho=0.2).groups for n in g.names]
    xs = {n: [] for n in names}
    hooks = [mods[n].register_forward_hook(lambda mod, i, o, n=n: xs[n].append(i[0].reshape(-1, 48 if
             "down" not in n else 72).double())) for n in names]
    with torch.no_grad():
        for b in batches():
            base(**b)
    for h in hooks:
        h.remove()
    model = copy.deepcopy(base)
    rep = compress_basis_sharing(model, st, 0.2, min_alpha=0)
    got = dict(model.named_modules())
    for g in rep.groups:
        X = torch.cat([torch.cat(xs[n]) for n in g["layers"]])  # (tokens of all the group's layers, m)
        S = torch.linalg.cholesky(X.T @ X)  # (m, m)
        Ws = [mods[n].weight.detach().double() for n in g["layers"]]
        s = torch.linalg.svdvals(torch.cat(Ws) @ S)
        err = sum(float(((W - got[n].weight.detach().double()) @ S).square().sum()) for W, n in zip(Ws, g["layers"]))
        # the float32 factors move the error by ~1e-7 of the total; a wrong Gram by percents of the tail
        assert abs(err - float((s[g["rank"]:] ** 2).sum())) <= 1e-5 * float((s ** 2).sum()), g["layers"]
    x = batches(k=1, seed=1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(x).logits).all()


def test_group_size_one_is_svd_llm_at_the_same_whole_model_ratio(decoder):
    """Every group private: the same ranks, weights and counts as compress(..., 'svd_llm', ratio=)."""
    base, st = decoder
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    rep = compress_basis_sharing(a, st, 0.2, group_size=1)
    ref = compress(b, "svd_llm", st, ratio=0.2)
    assert rep.params_after == ref.params_after and rep.layer_params_after == ref.layer_params_after
    ma, mb = dict(a.named_modules()), dict(b.named_modules())
    for name, lr in ref.layers.items():
        assert ma[name].rank == lr.rank
        assert torch.equal(ma[name].first.weight, mb[name].first.weight)
        assert torch.equal(ma[name].second.weight, mb[name].second.weight)


def test_shared_types_follow_the_authors_configs_and_can_be_overridden():
    gqa, mha, odd = tiny_decoder(), tiny_decoder(kv_heads=4), tiny_decoder(layers=5)
    assert plan_basis_sharing(gqa, rho=0.2).shared == ("q", "gate", "up")
    assert plan_basis_sharing(mha, rho=0.2).shared == ("q", "k", "v", "gate", "up")
    assert plan_basis_sharing(gqa, rho=0.2, shared=["o", "q"]).shared == ("q", "o")
    plan = plan_basis_sharing(odd, rho=0.2)
    groups = {(g.type, tuple(int(n.split(".")[2]) for n in g.names)): g.rank for g in plan.groups}
    assert [k[1] for k in groups if k[0] == "q"] == [(0, 1), (2, 3), (4,)]
    assert [k[1] for k in groups if k[0] == "down"] == [(i,) for i in range(5)]
    assert groups[("q", (4,))] == shared_basis_rank(48, 48, 0.2)  # a last, smaller group: its own g
    assert groups[("q", (0, 1))] == shared_basis_rank(48, 48, 0.2, group=2)
    for bad, msg in (("q", "collection of projection types"), (["q", "x"], "'x', not a projection type")):
        with pytest.raises(FisherkronError, match=msg):
            plan_basis_sharing(gqa, rho=0.2, shared=bad)


def test_refusals_are_one_line(decoder, tmp_path):
    base, st = decoder
    cases = [
        (lambda: compress_basis_sharing(tiny_bert(), st, 0.2), r"Llama-like decoder.*looked for model\.layers\.\{i\}"),
        (lambda: compress_basis_sharing(copy.deepcopy(base), st, 0.99), "ratio 0.990 is out of reach"),
        (lambda: compress_basis_sharing(copy.deepcopy(base), st, 1.0), "ratio must be"),
        (lambda: compress_basis_sharing(copy.deepcopy(base), st, 0.0), "ratio must be"),
        (lambda: compress_basis_sharing(tiny_decoder(seed=1), st, 0.2), "collected on other weights"),
        (lambda: compress_basis_sharing(copy.deepcopy(base), calibrate(base, tmp_path, ("abs_mean",)), 0.2),
         "'xxt' was not collected"),
    ]
    for run, msg in cases:
        with pytest.raises(FisherkronError, match=msg) as err:
            run()
        assert "\n" not in str(err.value)
    done = copy.deepcopy(base)
    compress_basis_sharing(done, st, 0.2)
    with pytest.raises(FisherkronError, match="is a SharedBasisLinear .already compressed"):
        compress_basis_sharing(done, st, 0.2)


def test_a_basis_sharing_model_saves_each_basis_once_and_reloads_exactly(tmp_path):
    """Save / load: every shared basis is stored once, reloaded as one object per group, logits bit-identical."""
    import json

    from fisherkron.hf.saving import load_compressed, save_compressed

    model = tiny_decoder()
    st = calibrate(model, tmp_path / "cal")
    compress_basis_sharing(model, st, 0.2)
    out = save_compressed(model, tmp_path / "m")
    meta = json.loads((out / "fisherkron.json").read_text())
    owners = {spec["basis"] for spec in meta["layers"].values() if spec.get("basis")}
    assert owners, "the manifest records no shared basis"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored_firsts = [k for k in f.keys() if k.endswith(".first.weight")]
    firsts = {id(m.first) for m in model.modules() if isinstance(m, SharedBasisLinear)}
    private = [m for m in model.modules() if hasattr(m, "first") and not isinstance(m, SharedBasisLinear)]
    assert len(stored_firsts) == len(firsts) + len(private)  # a basis per group, not per layer
    back = load_compressed(out)
    assert count_params(back) == count_params(model)
    b = back.model.layers
    assert b[0].self_attn.q_proj.first is b[1].self_attn.q_proj.first
    x = batches(k=1)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)
    back16 = load_compressed(out, dtype=torch.bfloat16)
    assert back16.model.layers[0].self_attn.q_proj.first is back16.model.layers[1].self_attn.q_proj.first
    dense = load_compressed(save_compressed(model, tmp_path / "merged", merged=True))
    with torch.no_grad():
        assert (dense(x).logits - model(x).logits).abs().max() < 1e-4


def test_compress_leaves_shared_basis_layers_alone(tmp_path):
    """compress() after Basis Sharing factorises only the layers still dense, never a shared basis's halves."""
    model = tiny_decoder()
    compress_basis_sharing(model, calibrate(model, tmp_path / "cal"), 0.2)
    shared = {n for n, m in model.named_modules() if isinstance(m, SharedBasisLinear)}
    with pytest.raises(FisherkronError, match="low-rank already"):
        compress(model, "svd", layers=r".*q_proj", ratio=0.2)
    assert {n for n, m in model.named_modules() if isinstance(m, SharedBasisLinear)} == shared
