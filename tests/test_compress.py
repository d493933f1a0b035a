"""Model surgery and save/reload on tiny random BERT and Llama models (tests/tiny_models.py)."""
import copy
import json

import pytest
import torch

from fisherkron.hf.calibration.entry import MFF_DTYPE

from fisherkron.hf.calibration import collect_calibration
from fisherkron import METHODS
from fisherkron.hf.surgery import compress, count_params
from fisherkron.core.conventions import FisherkronError
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.core.factorization import mff
from fisherkron.core.regularization import regularize
from fisherkron.core.wsvd import gfwsvd
from fisherkron.testing import MODEL_F32_REL, RELOAD, abs_sum_scale, assert_close_f32, linear_scale
import tiny_models
from tiny_models import tiny_bert


def tiny_llama(seed=0):
    """The shared tiny Llama with a tied LM head, which surgery must leave alone."""
    return tiny_models.tiny_llama(seed, tie_word_embeddings=True)


def batches(vocab, k=4, B=2, T=9, labels=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, vocab, (B, T), generator=g)
        lab = torch.randint(0, labels, (B,), generator=g) if labels else x.clone()
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": lab})
    return out


@pytest.fixture(scope="module")
def llama_stats(tmp_path_factory):
    model = tiny_llama()
    st = collect_calibration(model, batches(97), None, cache_dir=tmp_path_factory.mktemp("cal"))
    return model, st


@pytest.mark.parametrize("method", METHODS)
def test_every_method_compresses_and_counts_params(method, llama_stats):
    base, st = llama_stats
    model = copy.deepcopy(base)
    x = batches(97, k=1)[0]["input_ids"]
    rep = compress(model, method, st, rank=3, mff_options=dict(max_matvecs=60))
    lows = {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    assert set(lows) == set(st.layers) and len(lows) == 14
    # formula: each n x m layer (no bias in Llama) -> r (n + m)
    removed = sum(m.out_features * m.in_features - 3 * (m.out_features + m.in_features) for m in lows.values())
    assert rep.params_after == count_params(model) == count_params(base) - removed
    assert rep.ratio == pytest.approx(removed / count_params(base))
    logits = model(x).logits
    assert logits.shape == (2, 9, 97)
    assert torch.isfinite(logits).all()
    if method.startswith("gfwsvd") or method == "svd_llm":
        assert all(lr.alpha_A is not None for lr in rep.layers.values())


def test_gfwsvd_layer_equals_core_on_mff_factors(llama_stats):
    base, st = llama_stats
    model = copy.deepcopy(base)
    name = "model.layers.1.mlp.down_proj"
    compress(model, "gfwsvd", st, layers=name, rank=4)
    W = dict(base.named_modules())[name].weight.detach()
    res = mff(st.grads_path(name), init=st.kfac(name), dtype=MFF_DTYPE)  # the precision of a calibration's factors
    W2, W1 = gfwsvd(W, regularize(res.A, min_alpha=1e-3), regularize(res.B, min_alpha=1e-3), 4)  # compress default floor
    # the same computation along another path: at most the round-off of the float32 product (r = 4 terms)
    assert_close_f32(dict(model.named_modules())[name].weight, W2 @ W1, length=4, scale=abs_sum_scale(W2.T, W1),
                     what="compressed weight")


def test_full_rank_svd_keeps_the_function():
    model = tiny_bert()
    ref = copy.deepcopy(model)
    x = batches(50, k=1, labels=3)[0]
    name = "bert.encoder.layer.0.attention.self.query"
    rep = compress(model, "svd", layers=name.replace(".", r"\."), rank=20, skip_unprofitable=False)
    assert rep.ratio < 0  # full rank costs parameters: reported honestly
    # the layer itself: x W_1^T W_2^T + b against x W^T + b, float32 round-off of the nested sums
    low, lin = dict(model.named_modules())[name], dict(ref.named_modules())[name]
    cap = {}
    hook = lin.register_forward_hook(lambda m, i, o: cap.update(x=i[0]))
    with torch.no_grad():
        want = ref(**x).logits
        hook.remove()
        h = cap["x"]  # (B, T, 20): the layer's input
        scale, length = linear_scale(h, low.first.weight, low.second.weight, bias=low.second.bias)
        assert_close_f32(low(h), lin(h), length=length, scale=scale, what="full-rank SVD layer output")
        # and the model: logits moved by round-off only (the query layer barely moves them: see the layer check)
        got = model(**x).logits
    assert float((got - want).abs().max()) <= MODEL_F32_REL * float(want.abs().max())


def test_ablation_diag_uses_only_diagonals(llama_stats):
    base, st = llama_stats
    name = "model.layers.0.self_attn.o_proj"
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    compress(m1, "gfwsvd_diag", st, layers=name, rank=2)
    res = mff(st.grads_path(name), init=st.kfac(name), dtype=MFF_DTYPE)
    W = dict(base.named_modules())[name].weight.detach()
    W2, W1 = gfwsvd(W, regularize(torch.diag(torch.diagonal(res.A))), regularize(torch.diag(torch.diagonal(res.B))), 2)
    assert_close_f32(dict(m1.named_modules())[name].weight, W2 @ W1, length=2, scale=abs_sum_scale(W2.T, W1),
                     what="gfwsvd_diag weight")
    rep = compress(m2, "gfwsvd_offdiag", st, layers=name, rank=2)
    assert rep.layers[name].alpha_A >= 1.0  # the identity shift replacing the nulled diagonal


def test_ratio_target_is_met_and_reported():
    model = tiny_llama()
    before = count_params(model)
    rep = compress(model, "svd", layers=None, ratio=0.2)
    assert rep.ratio >= 0.2 and rep.ratio < 0.2 + 0.03
    assert rep.params_before == before and rep.params_after == count_params(model)
    with pytest.raises(FisherkronError, match="out of reach"):
        compress(tiny_llama(), "svd", layers="model.layers.0.mlp.up_proj", ratio=0.5)


def test_a_compression_counts_its_time_as_the_compression_phase(monkeypatch):
    """Provenance records say where a notebook's time went: compress's whole call is the "compression" phase (less
    the weighted SVDs nested in it), the building of the factorised layers included."""
    import time

    from fisherkron.core import phases
    from fisherkron.hf import surgery

    build = surgery.LowRankLinear.from_factors

    def slow_build(*a, **k):
        time.sleep(0.05)
        return build(*a, **k)

    monkeypatch.setattr(surgery.LowRankLinear, "from_factors", slow_build)
    phases.reset()
    compress(tiny_llama(), "svd", layers="model.layers.0.mlp.up_proj", rank=4)
    assert phases.seconds()["compression"] >= 0.05


def test_bad_ranks_and_missing_stats_give_one_line_errors(llama_stats):
    base, st = llama_stats
    with pytest.raises(FisherkronError, match=r"rank 25 is outside 1..min\(n, m\)=24 for layer model.layers.0"):
        compress(copy.deepcopy(base), "svd", layers=r"model\.layers\.0\.mlp\.up_proj", rank=25)
    with pytest.raises(FisherkronError, match="needs calibration statistics"):
        compress(copy.deepcopy(base), "gfwsvd", layers="model.layers.0.mlp.up_proj", rank=2)
    with pytest.raises(FisherkronError, match="unknown"):
        compress(copy.deepcopy(base), "pca", st, rank=2)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_save_load_gives_identical_logits(kind, tmp_path, llama_stats):
    if kind == "llama":
        model, st = copy.deepcopy(llama_stats[0]), llama_stats[1]
        rep = compress(model, "gfwsvd", st, ratio=0.15, mff_options=dict(max_matvecs=40))
        x = batches(97, k=1)[0]
    else:
        model = tiny_bert()
        rep = compress(model, "svd", rank=5)
        x = batches(50, k=1, labels=3)[0]
    with torch.no_grad():
        ref = model(**x).logits
    out = save_compressed(model, tmp_path / "c", report=rep, provenance={"test": kind})
    meta = json.loads((out / "fisherkron.json").read_text())
    assert meta["method"] == rep.method and len(meta["layers"]) == len(rep.ranks)
    assert not list(out.glob("*.py"))  # no remote code
    loaded = load_compressed(out)
    assert type(loaded) is type(model)
    assert sum(isinstance(m, LowRankLinear) for m in loaded.modules()) == len(rep.ranks)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, ref, **RELOAD)
    assert count_params(loaded) == rep.params_after
    if kind == "llama":
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    with pytest.raises(FisherkronError, match="not a fisherkron folder"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "x.txt").write_text("keep me")
        save_compressed(model, tmp_path / "other")
    assert (tmp_path / "other" / "x.txt").read_text() == "keep me"


def test_failure_midway_leaves_the_model_untouched(llama_stats, monkeypatch):
    base, st = llama_stats
    model = copy.deepcopy(base)
    x = batches(97, k=1)[0]["input_ids"]
    with torch.no_grad():
        ref = model(x).logits
    last = list(st.layers)[-1]
    real = st.diag_fisher
    seen = []

    def poisoned(name):  # the last layer's statistics are NaN: found after 13 layers were factorised
        seen.append(name)
        D = real(name)
        return D * float("nan") if name == last else D
    monkeypatch.setattr(st, "diag_fisher", poisoned)
    with pytest.raises(FisherkronError, match="NaN"):
        compress(model, "fwsvd", st, rank=3)
    assert len(seen) == 14
    assert not any(isinstance(m, LowRankLinear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)
