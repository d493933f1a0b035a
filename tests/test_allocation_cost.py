"""The allocation study (experiments.allocation_cost and the measured cases of llm_compression):
the cost bookkeeping, predictions against a hand sum, the target rule on a known table, and the measured
allocations end to end on a tiny random Llama (cached, keyed by what they measure, costs recorded)."""
import math

import pytest
import torch

from fisherkron.core.conventions import FisherkronError
from fisherkron.experiments import allocation_cost as ac
from fisherkron.experiments import llm_compression as lc
from fisherkron.hf.calibration import collect_calibration
from tiny_models import tiny_llama, token_batches


def test_cost_of_free_and_measuring_allocations():
    assert ac.cost("fisher", {"allocation_evaluations": 99}) == {"evaluations": 0, "seconds": 0.0, "kind": "free"}
    got = ac.cost("calibrated", {"allocation_evaluations": 5, "sweep_seconds": 2.5})
    assert got == {"evaluations": 5, "seconds": 2.5, "kind": "one point"}
    with pytest.raises(FisherkronError, match="records no evaluations"):
        ac.cost("sensitivity", {})
    with pytest.raises(FisherkronError, match="not one of"):
        ac.cost("greedy", {})


def test_predictions_sum_the_curves_at_the_chosen_ranks():
    curves = {"a": [9.0, 4.0, 1.0, 0.0], "b": [8.0, 2.0, 0.0]}
    rows = [{"method": "m", "allocation": "x", "target": 0.1, "ranks": {"a": 1, "b": None}, "loss": 3.5},
            {"method": "m", "allocation": "y", "target": 0.1, "ranks": {"a": 2, "b": 1}, "loss": 3.25}]
    p = ac.predictions(rows, curves, 3.0, scales={"a": 2.0, "b": 0.5})
    assert [x["predicted_raw"] for x in p] == [4.0, 3.0]  # a dense layer predicts nothing
    assert [x["predicted_calibrated"] for x in p] == [8.0, 3.0]  # 2 x 1 + 0.5 x 2
    assert [x["measured"] for x in p] == [0.5, 0.25]
    assert math.isnan(ac.predictions(rows, curves, 3.0)[0]["predicted_calibrated"])


def test_spearman_needs_three_finite_pairs():
    assert ac.spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert math.isnan(ac.spearman([1, 2, float("nan")], [1, 2, 3]))


def _row(m, a, t, ppl, ev):
    return {"method": m, "allocation": a, "target": t, "ppl_ptb": ppl, "evaluations": ev}


def test_target_on_a_known_table():
    rows = [_row("g", "sensitivity", 0.1, 100.0, 600), _row("g", "fisher", 0.1, 90.0, 0),
            _row("g", "calibrated", 0.1, 85.0, 100), _row("g", "lems", 0.1, 95.0, 100),
            # at 20 %: better quality than both, but too many evaluations and behind LEMS
            _row("g", "sensitivity", 0.2, 300.0, 600), _row("g", "fisher", 0.2, 400.0, 0),
            _row("g", "calibrated", 0.2, 330.0, 201), _row("g", "lems", 0.2, 320.0, 100)]
    got = ac.target(rows, ["g"], [0.1, 0.2, 0.3])
    assert got["g"][0.1]["met"] is True and got["g"][0.1]["better_of_sweep_fisher"] == 90.0
    t20 = got["g"][0.2]
    assert (t20["quality"], t20["cost"], t20["beats_lems"], t20["met"]) == (False, False, False, False)
    assert t20["shortfall"] == pytest.approx(0.1)
    assert got["g"][0.3]["met"] is None  # nothing measured there: undecided, never "met"


def test_head_to_head_counts_wins_and_the_geometric_mean_and_picks_the_target_variant():
    rows = [_row("g", "calibrated", 0.1, 100.0, 200), _row("g", "calibrated_kl", 0.1, 50.0, 200),
            _row("g", "calibrated", 0.2, 300.0, 200), _row("g", "calibrated_kl", 0.2, 300.0, 200),
            _row("h", "calibrated", 0.1, 40.0, 200), _row("h", "calibrated_kl", 0.1, 80.0, 200),
            _row("h", "calibrated", 0.2, 10.0, 200)]  # h at 20 %: no KL row, not a pair
    got = ac.head_to_head(rows, "calibrated_kl", "calibrated", ["g", "h"], [0.1, 0.2])
    assert got["wins"] == {"calibrated_kl": 1, "calibrated": 1} and got["ties"] == 1 and got["pairs"] == 3
    assert got["geomean"] == pytest.approx((0.5 * 1.0 * 2.0) ** (1 / 3))
    assert math.isnan(ac.head_to_head(rows, "calibrated_kl", "lems", ["g"], [0.1])["geomean"])
    # the target reads the variant it is given
    rows += [_row("g", "sensitivity", 0.1, 90.0, 1200), _row("g", "fisher", 0.1, 95.0, 0),
             _row("g", "lems", 0.1, 70.0, 200)]
    assert ac.target(rows, ["g"], [0.1], calibrated="calibrated_kl")["g"][0.1]["met"] is True
    assert ac.target(rows, ["g"], [0.1])["g"][0.1]["met"] is False


# ----------------------------------------------------------------------------- measured cases, end to end

def _batches(k, seed, B=2, T=12):
    return token_batches(k=k, seed=seed, B=B, T=T)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("alloc")
    mp = pytest.MonkeyPatch()
    mp.setenv("FISHERKRON_DATA", str(root))  # the sweeps' and one-point measurements' cache
    model = tiny_llama()
    stats = collect_calibration(model, _batches(4, 0), None, stats=lc.study_stats(), cache_dir=root / "cal")
    proto = lc.Protocol(model_name="tiny", k=4, heldout_k=2, select_k=2, sens_ratios=(0.3, 0.6), eval_seq_len=16,
                        mff_tol=1e-3)
    ids = {"wiki": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(5)),
           "ptb": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(6))}
    s = lc.Study(proto, model, None, stats, _batches(2, 1), _batches(2, 2), ids, list(stats.layers), "tiny-model",
                 "test-code", root / "studies")
    yield s
    mp.undo()


def test_measured_case_keys_name_what_they_measure():
    kw = dict(method="gfwsvd", ratio=0.1, kind="ppl", model="m", calibration="c", code="v", sweep="s")
    keys = {a: lc.case_key(lc.case_config(allocation=a, **kw)) for a in ("fisher", "calibrated", "calibrated_kl",
                                                                          "lems")}
    assert len(set(keys.values())) == 4
    other = lc.case_key(lc.case_config(allocation="calibrated", **{**kw, "sweep": "t"}))
    assert other != keys["calibrated"]  # another held-out set measures another point


def test_run_grid_measures_once_records_costs_and_reads_the_cache(study, monkeypatch):
    plan = {"gfwsvd": ["uniform", "fisher", "calibrated", "lems"]}
    rows = ac.run_grid(study, ["gfwsvd"], plan, [0.1, 0.2], progress=False)
    assert len(rows) == 8 and all(r["ratio"] >= r["target"] - 1e-9 for r in rows)
    n = len(study.names)
    for r in rows:
        if r["allocation"] in ("calibrated", "lems"):
            # one point per layer and the dense loss; the KL of lems also records the dense outputs once
            assert r["evaluations"] == n + 1 + (r["allocation"] == "lems")
            assert r["seconds"] > 0 and set(r["scales"] or {}) <= set(study.names)
        else:
            assert r["evaluations"] == 0
    cal = [r for r in rows if r["allocation"] == "calibrated"]
    assert set(cal[0]["scales"]) == set(study.names) and all(k > 0 for k in cal[0]["scales"].values())
    # the calibrated prediction of its own allocation is the sum of the ILP's per-layer costs
    from fisherkron.hf.allocation import fisher_curves

    curves, _ = fisher_curves(study.model, "gfwsvd", study.stats, study.names, mff_options=study.mff_options,
                              decompositions=study.decompositions_of("gfwsvd"))
    p = ac.predictions(cal, curves, 0.0, scales=cal[0]["scales"])
    for x, r in zip(p, cal):
        assert x["predicted_calibrated"] == pytest.approx(sum(r["predicted"].values()), rel=1e-9)

    def no_build(*a, **k):
        raise AssertionError("a cached case was compressed again")

    monkeypatch.setattr(study, "build", no_build)
    again = ac.run_grid(study, ["gfwsvd"], plan, [0.1, 0.2], progress=False)
    assert [r["ppl_ptb"] for r in again] == [r["ppl_ptb"] for r in rows]
