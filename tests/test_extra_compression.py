"""The extra-compression study (experiments.extra_compression): rows and keys, the score and model cache, seeds
aggregated, the tables and verdicts on known numbers, the training text kept apart, end to end on a tiny Llama."""
import math

import pandas as pd
import pytest
import torch

from fisherkron.core.conventions import FisherkronError
from fisherkron.experiments import extra_compression as xc
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf import recovery
from fisherkron.hf.data import c4_documents, lm_batches
from fisherkron.hf.recovery import check_disjoint
from tiny_models import tiny_llama, token_batches

#: two evaluations of the same float32 model on the same batches, one after a rebuild from the checkpoint
REBUILD = dict(rel=1e-6)


# ----------------------------------------------------------------------------- rows and settings

def test_rows_and_settings_refuse_what_has_no_meaning():
    assert xc.Row("gfwsvd", 0.2, "lora", 1, True).label == "gfwsvd|lora+rebalanced|0.2000|seed1"
    with pytest.raises(FisherkronError, match="needs a seed"):
        xc.Row("svd", 0.2, "dobi")
    with pytest.raises(FisherkronError, match="has no seed"):
        xc.Row("svd", 0.2, "allocated", 0)
    with pytest.raises(FisherkronError, match="only the LoRA recovery rebalances"):
        xc.Row("svd", 0.2, "dobi", 0, True)
    with pytest.raises(FisherkronError, match="stage 'x'"):
        xc.Row("svd", 0.2, "x", 0)
    with pytest.raises(FisherkronError, match="init must be"):
        xc.Training(init="random")
    with pytest.raises(FisherkronError, match="text must be"):
        xc.Training(text="ptb")
    assert [xc.row_name("svd_llm", s) for s in xc.STAGES] == ["SVD-LLM", "Dobi-SVD-LLM", "Dobi-SVD-LLM + LoRA"]
    t = xc.Training()
    assert "lora_lr" not in t.truncation() and "lr" in t.truncation() and "lora_lr" in t.recovery()


# ----------------------------------------------------------------------------- seeds, tables, verdicts

def _table():
    """Two methods at one ratio: (a) deterministic, (b) and (c) with two seeds; known numbers."""
    recs = []

    def add(m, stage, seed, wiki, ptb, acc, rebalance=False):
        recs.append({"method": m, "target": 0.2, "stage": stage, "seed": seed, "rebalance": rebalance,
                     "name": xc.row_name(m, stage, rebalance), "ratio": 0.2 + 1e-4, "ppl_wiki": wiki, "ppl_ptb": ptb,
                     **{t: acc for t in xc.TASKS4}, **{f"{t}_se": 0.05 for t in xc.TASKS4}, "acc4": acc,
                     "acc4_se": 0.025, "loss": math.log(wiki)})

    add("svd", "allocated", None, 40.0, 80.0, 0.40)
    add("gfwsvd", "allocated", None, 30.0, 60.0, 0.45)  # lead log(4/3) = 0.288 nats on both texts
    for s, (sv, gf) in enumerate([(20.0, 15.0), (22.0, 16.0)]):  # lead grows to ~0.30 (range ~0.05)
        add("svd", "dobi", s, sv, 2 * sv, 0.42)
        add("gfwsvd", "dobi", s, gf, 2 * gf, 0.46)
    for s, (sv, gf) in enumerate([(12.0, 12.1), (12.5, 12.4)]):  # lead vanishes
        add("svd", "lora", s, sv, 2 * sv, 0.44)
        add("gfwsvd", "lora", s, gf, 2 * gf, 0.44)
        add("gfwsvd", "lora", s, gf * 0.9, 2 * gf * 0.9, 0.45, rebalance=True)  # rebalancing helps by log(1/0.9)
    return pd.DataFrame(recs)


def test_aggregate_gives_mean_spread_and_count_per_row_group():
    agg = xc.aggregate(_table())
    assert len(agg) == 2 + 2 + 3  # (a) x 2, (b) x 2, (c) x 2 + rebalanced
    a = agg[(agg.method == "svd") & (agg.stage == "allocated")].iloc[0]
    assert a["n"] == 1 and a["ppl_wiki"] == 40.0 and a["ppl_wiki_sd"] == 0.0
    b = agg[(agg.method == "svd") & (agg.stage == "dobi")].iloc[0]
    assert b["n"] == 2 and b["ppl_wiki"] == 21.0 and b["ppl_wiki_sd"] == pytest.approx(math.sqrt(2.0))
    assert (b["ppl_wiki_min"], b["ppl_wiki_max"]) == (20.0, 22.0) and b["arc_easy_se"] == 0.05
    reb = agg[agg.rebalance.astype(bool)].iloc[0]
    assert reb["name"] == "Dobi-GFWSVD + LoRA (rebalanced)" and reb["n"] == 2


def test_results_table_bolds_the_best_per_block_and_shows_the_seed_spread():
    agg = xc.aggregate(_table())
    dense = {"ppl_wiki": 10.0, "ppl_ptb": 20.0, **{t: 0.5 for t in xc.TASKS4}, "acc4": 0.5}
    tab = xc.results_table(agg, [0.2], dense)
    assert tab.iloc[0]["Method"] == "Full model" and tab.iloc[0]["PTB"] == "20.00"
    assert list(tab["Block"].iloc[1:].unique()) == ["20 %, at allocated ranks (fisher)",
                                                   "20 %, learned truncation (Dobi)", "20 %, + LoRA recovery"]
    row = tab[tab.Method == "Dobi-GFWSVD"].iloc[0]
    assert row["Wiki (WT2 role)"] == "**15.50 ± 0.71**" and row["ARC-E"] == "**0.460 ± 0.000**"  # n = 2
    assert tab[tab.Method == "Dobi-SVD"].iloc[0]["Wiki (WT2 role)"] == "21.00 ± 1.41"
    assert tab[tab.Method == "GFWSVD"].iloc[0]["PTB"] == "**60.00**"  # deterministic: no spread
    best = tab[tab.Block == "20 %, + LoRA recovery"]
    assert best[best["Wiki (WT2 role)"].str.startswith("**")]["Method"].tolist() == ["Dobi-GFWSVD + LoRA (rebalanced)"]
    tex = ls.latex(tab, "caption", "tab:x")
    assert r"\textbf{15.50 $\pm$ 0.71}" in tex and tex.count(r"\midrule") == 1 + 3


def test_every_score_column_of_the_results_table_gets_a_verify_tolerance():
    """make verify compares a seed mean with a tolerance; a score column that fell to 'exact' (HellaSwag did, as
    'HSwag', before the accuracy pattern knew that name) fails on the last bit of any CPU."""
    tab = xc.results_table(xc.aggregate(_table()), [0.2], {c: 1.0 for c in (*xc.COLUMNS, "acc4")})
    tol = ls.tolerances(tab, seeds=2)
    assert {c for c, t in tol.items() if t == "exact"} == {"Block", "Method"}
    assert tol["HSwag"] == tol["ARC-E"] == "abs=0.05 + 3*pm/sqrt(2)" and tol["PTB"] == "rel=0.05 + 3*pm/sqrt(2)"


def test_ahead_requires_every_seed_ahead():
    df = _table()
    r = xc.ahead(df, 0.2, "dobi", "gfwsvd", "svd", "ppl_wiki")
    assert r["separated"] and r["diff"] == pytest.approx(5.5)
    r = xc.ahead(df, 0.2, "lora", "gfwsvd", "svd", "ppl_wiki")
    assert not r["separated"] and r["diff"] == pytest.approx(0.0)  # 12.25 vs 12.25, ranges overlap
    acc = xc.ahead(df, 0.2, "dobi", "gfwsvd", "svd", "acc4")  # higher is better for accuracies
    assert acc["separated"] and acc["diff"] == pytest.approx(0.04)
    assert not xc.ahead(df, 0.4, "dobi", "gfwsvd", "svd", "ppl_wiki")["separated"]  # no rows: never ahead


def test_leads_pair_the_seeds_and_the_change_is_classified():
    df = _table()
    before = xc.leads(df, 0.2, "allocated", "gfwsvd", "svd", "ppl_ptb")
    assert before == [pytest.approx(math.log(4 / 3))]
    after = xc.leads(df, 0.2, "dobi", "gfwsvd", "svd", "ppl_ptb")
    assert after == [pytest.approx(math.log(20 / 15)), pytest.approx(math.log(22 / 16))]
    assert xc.lead_change(before[0], after)["verdict"] == "holds"  # 0.288 -> 0.303, range 0.031
    lora = xc.leads(df, 0.2, "lora", "gfwsvd", "svd", "ppl_ptb")
    assert xc.lead_change(before[0], lora)["verdict"] == "vanishes"
    assert xc.lead_change(0.0, [0.2, 0.21])["verdict"] == "appears"
    assert xc.lead_change(0.0, [0.001, -0.002])["verdict"] == "level"
    assert xc.lead_change(0.2, [0.1, 0.11])["verdict"] == "shrinks"
    assert xc.lead_change(0.2, [])["verdict"] == "missing"
    assert xc.lead_change(0.2, [float("nan")])["verdict"] == "missing"  # an overflowed perplexity has no lead
    assert xc.lead_change(0.2, [0.3, float("nan")])["verdict"] == "grows"
    wide = xc.lead_change(1.0, [0.8, 1.4])  # a seed range of 0.6 swallows a change of 0.1
    assert wide["verdict"] == "holds" and wide["noise"] == pytest.approx(0.6)
    assert xc.lead_change(0.1, [0.0, 0.5])["verdict"] == "vanishes"  # 0.25 is within the range 0.5 of zero


def test_standing_counts_each_ratio_and_texts_lead_before_training_once_and_after_each_stage():
    df = _table()
    changes = pd.DataFrame([
        {"other": "svd", "target": 0.2, "text": c, "stage": st,
         **xc.lead_change(xc.leads(df, 0.2, "allocated", "gfwsvd", "svd", c)[0],
                          xc.leads(df, 0.2, st, "gfwsvd", "svd", c))}
        for c in ("ppl_wiki", "ppl_ptb") for st in ("dobi", "lora")])
    # (a) 0.288 and (b) ~0.30 ahead on both texts; (c)'s seeds -0.008 and +0.008 average to level
    assert xc.standing(changes) == {"svd": {"behind": 0, "level": 2, "ahead": 4, "of": 6}}
    assert xc.standing(changes.assign(after=-changes["after"]))["svd"]["behind"] == 2  # (b) now behind; (a) as before
    # a mean lead inside its seed spread is level, as lead_change calls it, even beyond tol
    wide = changes.assign(after=-0.03, noise=0.05)
    assert xc.standing(wide)["svd"] == {"behind": 0, "level": 4, "ahead": 2, "of": 6}
    assert xc.lead_change(-0.07, [-0.055, -0.005])["verdict"] == "level"  # the same reading as lead_change's


def test_rebalance_effect_and_collapse():
    df = _table()
    r = xc.rebalance_effect(df, "gfwsvd", 0.2, "ppl_wiki")
    assert r["verdict"] == "helps" and r["gain"] == pytest.approx(math.log(1 / 0.9))
    assert xc.rebalance_effect(df, "svd", 0.2, "ppl_wiki")["verdict"] == "missing"
    flat = df.copy()
    flat.loc[flat.rebalance, "ppl_wiki"] /= 0.9
    assert xc.rebalance_effect(flat, "gfwsvd", 0.2, "ppl_wiki")["verdict"] == "no measurable difference"
    dense = {"ppl_wiki": 1.0, "ppl_ptb": 2.0}
    assert xc.all_collapsed(df, dense, 0.2, 10.0)  # every wiki perplexity is > 10x
    assert not xc.all_collapsed(df, dense, 0.2, 30.0)  # the LoRA rows are not
    assert not xc.all_collapsed(df, dense, 0.4, 10.0)  # no rows at 40 %: nothing to fall back from


def test_training_curves_flatten_the_histories():
    recs = [{"method": "svd", "target": 0.2, "stage": "allocated", "seed": None, "rebalance": False, "heldout": {}},
            {"method": "svd", "target": 0.2, "stage": "dobi", "seed": 0, "rebalance": False,
             "heldout": {"history": [{"step": 0, "loss": 9.0, "lm": 8.0, "ratio": 0.19, "lr": 5.0},
                                     {"step": 1, "loss": 7.0, "lm": 6.5, "ratio": 0.2, "lr": 4.5}]}},
            {"method": "svd", "target": 0.2, "stage": "lora", "seed": 0, "rebalance": True,
             "heldout": {"history": [{"step": 0, "loss": 2.0, "lr": 1e-4, "tokens": 10}]}}]
    c = xc.training_curves(recs)
    assert c["phase"].tolist() == ["truncation", "truncation", "recovery"]
    assert c["soft_ratio"].tolist()[:2] == [0.19, 0.2] and c["rebalance"].tolist() == [False, False, True]


# ----------------------------------------------------------------------------- training text

class _Chars:
    """A character tokenizer: every character one id (its code point), decode the inverse."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(int(i)) for i in ids if int(i))


def test_training_documents_leave_out_calibration_heldout_and_evaluation_text(tmp_path, monkeypatch):
    docs = c4_documents()
    proto = lc.Protocol(model_name="tiny", k=3, batch_size=1, seq_len=400)
    study = lc.Study(proto, None, _Chars(), None, [], [], {}, [], "m", "c", None)
    planted = {"planted": [docs[7][200:700]]}
    kept, rep = xc.training_documents(study, evaluation=planted, cache_dir=tmp_path)
    assert rep["candidates"] == 500 and rep["kept"] == len(kept) and rep["calibration_windows"] == 3
    assert 1 <= rep["dropped"]["calibration windows"] <= 6 and rep["dropped"]["evaluation texts"] == 1
    assert docs[7] not in kept and set(kept) <= set(docs[:500])
    calib = lm_batches(_Chars(), docs[:500], k=3, batch_size=1, seq_len=400, seed=0)
    windows = [_Chars().decode(x) for b in calib for x in b["input_ids"]]
    assert check_disjoint(kept, {"w": windows, "h": docs[500:], **planted}) == []
    with monkeypatch.context() as m:  # the second call reads the dropped documents from the cache
        m.setattr(recovery, "check_disjoint", lambda *a, **k: pytest.fail("checked again"))
        assert xc.training_documents(study, evaluation=planted, cache_dir=tmp_path) == (kept, rep)
        with pytest.raises(BaseException, match="checked again"):  # other evaluation texts: another key
            xc.training_documents(study, evaluation={"planted": [docs[8][:300]]}, cache_dir=tmp_path)


# ----------------------------------------------------------------------------- the study, end to end

@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    root = tmp_path_factory.mktemp("extra")
    mp = pytest.MonkeyPatch()
    mp.setenv("FISHERKRON_DATA", str(root))
    model = tiny_llama()
    stats = collect_calibration(model, token_batches(k=4, seed=0), None, stats=lc.study_stats(),
                                cache_dir=root / "cal")
    proto = lc.Protocol(model_name="tiny", k=4, eval_seq_len=16, mff_tol=1e-3)
    ids = {"wiki": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(5)),
           "ptb": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(6))}
    study = lc.Study(proto, model, None, stats, token_batches(k=2, seed=1), token_batches(k=2, seed=2), ids,
                     list(stats.layers), "tiny-model", "test-code", root / "decoder")
    training = xc.Training(allocation="uniform", train_k=3, trunc_steps=3, lora_steps=2, lora_lr=1e-2,
                           checkpoint_every=1)
    e = xc.ExtraStudy(study, training, [], {}, root / "extra", fallback_dirs=(study.cache_dir,))
    e._batches.update({s: token_batches(k=3, seed=10 + s) for s in (0, 1)})  # no tokenizer in the tiny study
    yield e
    mp.undo()


def test_keys_separate_what_changes_a_trained_model(ex):
    base = ex.train_config(xc.Row("gfwsvd", 0.2, "dobi", 0))
    assert base != ex.train_config(xc.Row("gfwsvd", 0.2, "dobi", 1))  # seed (and its data)
    assert base != ex.train_config(xc.Row("gfwsvd", 0.3, "dobi", 0))
    assert base != ex.train_config(xc.Row("svd_llm", 0.2, "dobi", 0))
    lora = ex.train_config(xc.Row("gfwsvd", 0.2, "lora", 0))
    assert lora["truncation"] == base["truncation"] and "recovery" not in base
    assert lora != ex.train_config(xc.Row("gfwsvd", 0.2, "lora", 0, True))
    heldout = ex.config(xc.Row("gfwsvd", 0.2, "dobi", 0), "heldout")
    assert heldout != ex.config(xc.Row("gfwsvd", 0.2, "dobi", 0), "ppl") and heldout["evaluation"]
    other = xc.ExtraStudy(ex.study, xc.Training(train_k=3, trunc_steps=4), [], {}, ex.cache_dir)
    other._batches.update(ex._batches)
    assert other.train_config(xc.Row("gfwsvd", 0.2, "dobi", 0)) != base  # a training setting
    # (a) is the decoder study's case under its key; plain SVD's fisher allocation reads the calibration
    assert ex.config(xc.Row("gfwsvd", 0.2, "allocated"), "ppl") == ex.study.config(lc.Case("gfwsvd", "uniform", 0.2),
                                                                                   "ppl")
    assert ex.config(xc.Row("svd", 0.2, "allocated"), "ppl")["calibration"] is None  # uniform SVD reads none
    fisher = xc.ExtraStudy(ex.study, xc.Training(), [], {}, ex.cache_dir)
    assert fisher.config(xc.Row("svd", 0.2, "allocated"), "ppl")["calibration"] == ex.study.stats.key
    assert ex.study.config(lc.Case("svd", "fisher", 0.2), "ppl")["calibration"] == ex.study.stats.key


def test_rows_train_once_are_cached_and_rebuild_from_their_checkpoint(ex, monkeypatch):
    rows, records = xc.run_rows(ex, ["svd_llm"], [0.2], [0], rebalance_methods=["svd_llm"], kinds=("heldout", "ppl"),
                                progress=False)
    assert [(r["stage"], r["rebalance"]) for r in rows] == [("allocated", False), ("dobi", False), ("lora", False),
                                                           ("lora", True)]
    a, b, c, _ = rows
    assert all(r["ratio"] >= 0.2 - 1e-9 for r in rows)
    assert b["ratio"] == pytest.approx(c["ratio"], abs=0)  # LoRA merged: the ratio survives
    dobi = records[1]["heldout"]
    assert records[1]["heldout"]["init_ranks"] == records[0]["heldout"]["ranks"]  # (b) starts at (a)'s ranks
    assert len(dobi["history"]) == 3 and len(records[2]["heldout"]["history"]) == 2
    # (c) is (b) trained further: another model (whether 2 steps lower the loss on random held-out tokens is
    # luck; that recovery lowers its training loss is test_recovery's)
    assert c["loss"] != b["loss"]
    runs = sorted(p.name.split("-")[0] for p in (ex.cache_dir / "runs").glob("*.pt"))
    assert runs == ["dobi", "lora", "lora"]
    assert ex.study.decompositions_of("svd_llm").misses == len(ex.study.names)  # (a), (b), (c) share one SVD each

    def no_build(*a, **k):
        raise AssertionError("a cached row was built again")

    with monkeypatch.context() as m:
        m.setattr(ex, "build", no_build)
        assert xc.run_rows(ex, ["svd_llm"], [0.2], [0], rebalance_methods=["svd_llm"], kinds=("heldout", "ppl"),
                           progress=False)[0] == rows
    # a lost score is computed again from the kept checkpoint, without training
    path = ex.cache_dir / f"{lc.case_key(ex.config(xc.Row('svd_llm', 0.2, 'lora', 0), 'ppl'))}.json"
    path.unlink()
    before = dict(ex.timings)
    again = ex.scores(xc.Row("svd_llm", 0.2, "lora", 0), ("heldout", "ppl"))
    assert again["ppl"]["ptb"] == pytest.approx(c["ppl_ptb"], **REBUILD)
    assert ex.timings.get("truncation") == before.get("truncation")
    assert ex.timings.get("recovery") == before.get("recovery") and ex.timings["rebuild"] > before.get("rebuild", 0)


def test_allocated_rows_and_the_dense_model_are_read_from_the_decoder_study_cache(ex, monkeypatch):
    ex.study.scores(lc.Case("svd_llm", "uniform", 0.3), ("heldout", "ppl"))  # the decoder study scored them
    dense = ex.study.scores(lc.Case("dense", "dense", 0.0), ("heldout", "ppl"))
    mine = sorted(ex.cache_dir.glob("*.json"))
    with monkeypatch.context() as m:
        m.setattr(ex.study, "build", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built again")))
        got = ex.scores(xc.Row("svd_llm", 0.3, "allocated"), ("heldout", "ppl"))
        assert math.isfinite(got["ppl"]["ptb"]) and ex.dense(("heldout", "ppl")) == dense
        with pytest.raises(AssertionError, match="built again"):  # another ratio: not in the decoder's cache
            ex.scores(xc.Row("svd_llm", 0.35, "allocated"), ("heldout",))
    assert sorted(ex.cache_dir.glob("*.json")) == mine  # nothing written: they were the decoder study's
