"""LoRA recovery of a compressed model's factors, and training text kept apart from evaluation text."""

import pytest
import torch
from torch import nn

from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.hf.budget import count_params
from fisherkron.hf.data import c4_documents
from fisherkron.hf.recovery import (check_disjoint, evaluation_texts, lowrank_layers, lr_factor, normalise,
                                    rebalance_factors, recover)
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.hf.sensitivity import mean_loss
from fisherkron.hf.surgery import compress
from fisherkron.testing import FLOAT64, RELOAD
from tiny_models import tiny_llama

#: rebalancing multiplies by c and divides by c: in float64 the product moves by a few ulps
REBALANCE = FLOAT64


def batches(k=4, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, 97, (B, T), generator=g)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def compressed(seed=0):
    model = tiny_llama(seed)
    compress(model, "svd", None, ratio=0.3)
    return model


# ----------------------------------------------------------------------------- the factors

def test_rebalancing_leaves_each_product_unchanged_and_equalises_the_norms():
    g = torch.Generator().manual_seed(0)
    lows = nn.ModuleList([LowRankLinear.from_factors(torch.randn(7, 3, generator=g, dtype=torch.float64) * 9.0,
                                                     torch.randn(3, 5, generator=g, dtype=torch.float64) / 4.0),
                          LowRankLinear.from_factors(torch.randn(5, 2, generator=g, dtype=torch.float64),
                                                     torch.randn(2, 7, generator=g, dtype=torch.float64) * 30.0)])
    before = [low.weight.detach().clone() for low in lows]
    scales = rebalance_factors(lows)
    assert set(scales) == {"0", "1"} and all(c != 1.0 for c in scales.values())
    for low, W in zip(lows, before):
        torch.testing.assert_close(low.weight.detach(), W, **REBALANCE)
        torch.testing.assert_close(low.first.weight.detach().norm(), low.second.weight.detach().norm(), **FLOAT64)


def test_the_learning_rate_warms_up_then_decays_to_the_floor():
    total, warm = 20, 4
    cos = [lr_factor(t, total, warm, "cosine", 0.1) for t in range(total)]
    lin = [lr_factor(t, total, warm, "linear", 0.1) for t in range(total)]
    assert cos[:warm] == [0.25, 0.5, 0.75, 1.0] and cos[warm] == 1.0 and lin[warm] == 1.0
    assert all(a >= b for a, b in zip(cos[warm:], cos[warm + 1:])) and all(a > b for a, b in zip(lin[warm:], lin[warm + 1:]))
    assert lr_factor(total, total, warm, "cosine", 0.1) == pytest.approx(0.1)
    assert lin[warm + 8] == pytest.approx(0.1 + 0.9 * 0.5)


# ----------------------------------------------------------------------------- training

@pytest.mark.parametrize("rebalance", [False, True])
def test_recovery_reduces_the_training_loss_and_keeps_every_shape(rebalance):
    model = compressed()
    shapes = {n: (m.first.weight.shape, m.second.weight.shape) for n, m in model.named_modules()
              if isinstance(m, LowRankLinear)}
    others = {k: v.clone() for k, v in model.state_dict().items() if ".first." not in k and ".second." not in k}
    params = count_params(model)
    data = batches()
    before = mean_loss(model, data)
    report = recover(model, data, steps=30, lr=5e-3, rebalance=rebalance)
    after = mean_loss(model, data)
    assert after < before - 0.05, (before, after)
    assert report.params_before == report.params_after == count_params(model) == params
    assert {n: (m.first.weight.shape, m.second.weight.shape) for n, m in model.named_modules()
            if isinstance(m, LowRankLinear)} == shapes
    assert not any("lora" in n for n, _ in model.named_modules())
    state = model.state_dict()
    assert state.keys() >= others.keys() and all(torch.equal(state[k], v) for k, v in others.items())
    assert bool(report.rebalanced) == rebalance and report.steps == 30 and len(report.losses) == 30


def test_one_factor_only_trains_only_that_factor():
    model = compressed()
    firsts = {n: model.get_submodule(n).first.weight.detach().clone() for n in lowrank_layers(model)}
    recover(model, batches(), steps=3, lr=5e-3, targets=("second",))
    assert all(torch.equal(model.get_submodule(n).first.weight, W) for n, W in firsts.items())


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    options = dict(steps=6, accumulate=3, lr=5e-3, lora_dropout=0.2, rebalance=True, checkpoint_every=4)
    whole_model = compressed()
    whole = recover(whole_model, batches(), **options)

    def stop(step, record):
        if step == 3:
            raise KeyboardInterrupt

    model = compressed()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = tmp_path / "recovery.pt"
    with pytest.raises(KeyboardInterrupt):
        recover(model, batches(), checkpoint=ckpt, callback=stop, **options)
    assert model.state_dict().keys() == state.keys()  # the LoRA layers are gone, the factors are back
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    resumed = recover(model, batches(), checkpoint=ckpt, **options)
    assert resumed.resumed_at == 3 and resumed.history == whole.history
    got, ref = model.state_dict(), whole_model.state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    with pytest.raises(FisherkronError, match="another recovery run"):
        recover(compressed(), batches(), checkpoint=ckpt, **{**options, "lr": 1e-3})


def test_the_token_budget_sets_the_steps_and_the_result_saves_and_reloads(tmp_path):
    model = compressed()
    report = recover(model, batches(), tokens=5 * 2 * 18 + 1, accumulate=2, lr=5e-3)  # 18 tokens a batch
    assert report.steps == 6 and report.tokens == 6 * 2 * 18
    out = save_compressed(model, tmp_path / "recovered", report=report.to_dict())
    loaded = load_compressed(out)
    x = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, model(**x).logits, **RELOAD)


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(FisherkronError, match="no LowRankLinear"):
        recover(tiny_llama(), batches(), steps=1)
    with pytest.raises(FisherkronError, match="targets"):
        recover(compressed(), batches(), steps=1, targets=("W1",))
    with pytest.raises(FisherkronError, match="not both"):
        recover(compressed(), batches(), steps=1, tokens=10)


# ----------------------------------------------------------------------------- training text vs evaluation text

@pytest.fixture(scope="module")
def evaluation():
    return evaluation_texts()


def test_the_evaluation_texts_cover_every_evaluation(evaluation):
    tasks = {s.split("/")[0].rsplit("_", 1)[0] for s in evaluation}
    assert {"wiki", "ptb", "arc_easy", "arc_challenge", "piqa", "hellaswag", "winogrande", "openbookqa",
            "mmlu"} <= tasks | {s.split("/")[0] for s in evaluation}
    assert all(texts and all(isinstance(t, str) for t in texts) for texts in evaluation.values())


def test_planted_overlaps_are_found_wherever_they_sit(evaluation):
    article = next(a for a in evaluation["wiki_text"][10:] if len(a) > 3000)
    ptb = evaluation["ptb_test"][0]
    sentence = next(s for s in ptb.split("\n") if len(normalise(s)) > 140)
    question = max(evaluation["piqa_validation"], key=len)
    docs = ["An unrelated page about gardening, compost and the weather in spring. " * 5,
            "Intro text. " + article[500:800] + " Outro text.",  # a Wikipedia passage inside a page
            sentence.replace(" n't", "n't").replace(" 's", "'s").upper(),  # a PTB sentence, cased and detokenised
            question,  # a whole lm-eval document
            normalise(article)[1000:1080]]  # shorter than the span, inside an article
    hits = check_disjoint(docs, evaluation)
    assert {(o.document, o.source) for o in hits} == {(1, "wiki_text"), (2, "ptb_test"), (3, "piqa_validation"),
                                                     (4, "wiki_text")}
    assert all(o.text in normalise(" ".join(evaluation[o.source])) for o in hits)


def test_normalise_keeps_exactly_the_letters_a_z_of_the_lower_cased_text():
    """Byte deletion gives what the regular expression [^a-z] leaves, for text outside ASCII too (the Kelvin
    sign lower-cases to an ASCII k, a dotted capital I to an i and a combining dot)."""
    import random
    import re

    ptb, other = re.compile(r"<unk>|\bN\b"), re.compile(r"[^a-z]+")
    rng = random.Random(0)
    alphabet = "aZ9 -'<>unkN\u212a\u0130\u00e9\u00df\u03a3\u4e2d\n\t|"
    texts = ["Don't stop -- N <unk> Believin' 1979!", "\u212aelvin \u0130stanbul caf\u00e9 Stra\u00dfe", ""]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(40))) for _ in range(300)]
    for t in texts:
        assert normalise(t) == other.sub("", ptb.sub(" ", t).lower()), t


def test_the_c4_training_documents_share_no_span_with_any_evaluation_text(evaluation):
    assert check_disjoint(c4_documents(), evaluation) == []
