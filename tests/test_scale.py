"""The scale study's verdicts (experiments.scale) on constructed results whose answers are known: the gap to the best
rival with its paired standard error, the trend over size, the share shrinkage closes, the ranking across models."""
import math

import numpy as np
import pytest

from fisherkron.experiments import scale as sc

TOKENS = 100


def _windows(log_ppl: float, noise: np.ndarray) -> dict:
    """Two texts of 8 windows whose mean NLL per token is ``log_ppl`` plus the windows' ``noise``."""
    return {t: {"nll": list((log_ppl + noise[i]) * TOKENS), "tokens": TOKENS} for i, t in enumerate(("wiki", "ptb"))}


def _model(name: str, block_params: float, log_ppl: dict, loss: dict | None = None, seed: int = 0) -> dict:
    """One model's result: ``log_ppl[(method, allocation, target)]``; a window's noise is shared by every case of
    the model (the same windows), so paired gaps are exact up to each case's own small jitter."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(0, 0.3, (2, 8))
    rows = []
    for (m, a, t), v in log_ppl.items():
        w = _windows(v, shared + rng.normal(0, 0.001, (2, 8)))
        rows.append({"model": name, "method": m, "allocation": a, "target": t, "windows": w,
                     "ppl_ptb": sc.window_ppl(w["ptb"]), "loss": (loss or {}).get((m, a, t), v)})
    return {"model": name, "block_params": block_params, "rows": rows}


def _cases(gfwsvd: float, svd_llm: float, kfac: float, shrunk: float, t: float = 0.1) -> dict:
    out = {}
    for a in ("fisher", "calibrated_kl"):
        bump = 0.0 if a == "calibrated_kl" else 0.5  # calibrated_kl the better allocation for every method
        out |= {("gfwsvd", a, t): gfwsvd + bump, ("svd_llm", a, t): svd_llm + bump, ("kfac_svd", a, t): kfac + bump,
                ("gfwsvd_shrunk", a, t): shrunk + bump}
    return out


def test_the_gap_is_to_the_rival_that_beats_gfwsvd_by_the_most_each_with_its_best_allocation():
    res = _model("m", 1e8, _cases(gfwsvd=3.0, svd_llm=2.8, kfac=2.5, shrunk=3.0))
    (row,) = sc.gap_rows([res], [0.1])
    assert row["allocation"] == "calibrated_kl" and row["best_rival"] == "kfac_svd"
    assert row["gap"] == pytest.approx(0.5, abs=0.01) and row["gap_svd_llm"] == pytest.approx(0.2, abs=0.01)
    assert 0 < row["se"] < 0.01 and row["windows"] == 16  # paired: the shared window noise cancels


def test_trend_shrinks_grows_or_cannot_tell():
    small = _model("small", 1e8, _cases(3.0, 2.8, 2.5, 3.0), seed=1)
    for big_gap, want in ((0.1, "shrinks"), (0.9, "grows"), (0.5005, None)):
        big = _model("big", 1e9, _cases(2.5 + big_gap, 2.8, 2.5, 3.0), seed=2)
        tr = sc.trend(sc.gap_rows([small, big], [0.1]), 0.1)
        assert tr["models"] == 2 and tr["smallest"] == "small" and tr["largest"] == "big"
        assert tr["change"] == pytest.approx(big_gap - 0.5, abs=0.01)
        assert tr["slope_per_decade"] == pytest.approx(big_gap - 0.5, abs=0.01)  # one decade apart
        assert (tr["shrinks"], tr["grows"]) == (want == "shrinks", want == "grows")
    assert sc.trend([], 0.1) == {"models": 0}


def test_shrinkage_effect_is_the_share_of_the_gap_to_kfac_svd_it_closes():
    res = _model("m", 1e8, _cases(gfwsvd=3.0, svd_llm=2.8, kfac=2.5, shrunk=2.9))
    (e,) = sc.shrinkage_effect([res], [0.1])
    assert e["shrunk_vs_plain"] == pytest.approx(-0.1, abs=0.01) and e["se"] < 0.01
    assert e["gap_plain_to_kfac"] == pytest.approx(0.5, abs=0.01)
    assert e["share_closed"] == pytest.approx(0.2, abs=0.02)
    ahead = _model("m", 1e8, _cases(gfwsvd=2.4, svd_llm=2.8, kfac=2.5, shrunk=2.4))
    assert math.isnan(sc.shrinkage_effect([ahead], [0.1])[0]["share_closed"])  # GFWSVD not behind: nothing to close


def test_rankings_order_the_methods_and_compare_models_by_kendalls_tau():
    a = _model("a", 1e8, _cases(gfwsvd=3.0, svd_llm=2.8, kfac=2.5, shrunk=2.9), seed=3)
    b = _model("b", 1e9, _cases(gfwsvd=3.0, svd_llm=2.8, kfac=2.5, shrunk=2.9), seed=4)
    c = _model("c", 2e9, _cases(gfwsvd=2.0, svd_llm=2.8, kfac=2.9, shrunk=2.1), seed=5)
    rk = sc.rankings([a, b, c], 0.1)
    assert rk["order"]["a"] == ["kfac_svd", "svd_llm", "gfwsvd_shrunk", "gfwsvd"]
    assert rk["kendall_tau"]["a / b"] == pytest.approx(1.0)
    assert rk["kendall_tau"]["a / c"] == pytest.approx(-1.0)  # the order reversed


def test_a_finished_model_is_read_back_without_calibrating_it_again(tmp_path, monkeypatch):
    from fisherkron import hf
    from fisherkron.experiments import llm_compression as lc
    from tiny_models import tiny_llama

    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path))
    model = tiny_llama()
    monkeypatch.setattr(hf, "load_model", lambda name, **kw: (model, None))
    monkeypatch.setattr(lc, "check_reachable", lambda *a: None)
    proto = lc.Protocol.from_params({"model_name": "tiny", "k": 2})
    zs = {("dense", "dense", 0.0)}
    from fisherkron.hf.calibration import model_fingerprint

    path = sc.model_record_path(proto, ("gfwsvd",), ("fisher",), (0.1,), zs, model_fingerprint(model))
    kept = {"model": "tiny", "rows": [{"method": "dense", "ppl_ptb": 1.5}], "timings": {"compress": 9.0},
            "first": {"compress": 9.0}, "intensities": []}
    sc.write_model_record(path, kept)

    def no_prepare(*a, **k):
        raise AssertionError("a finished model must not be prepared again")

    monkeypatch.setattr(lc, "prepare", no_prepare)
    got = sc.run_model(proto, ("gfwsvd",), ("fisher",), (0.1,), zero_shot=[("dense", "dense", 0.0)], progress=False)
    assert got["rows"] == kept["rows"] and got["first"] == kept["first"]
    assert got["timings"] == {} and got["cached"] == {"model record": 1}
    # anything else of the study names another record: another k, another ratio, other weights
    other = lc.Protocol.from_params({"model_name": "tiny", "k": 3})
    assert sc.model_record_path(other, ("gfwsvd",), ("fisher",), (0.1,), zs, model_fingerprint(model)) != path
    assert sc.model_record_path(proto, ("gfwsvd",), ("fisher",), (0.2,), zs, model_fingerprint(model)) != path
    assert sc.model_record_path(proto, ("gfwsvd",), ("fisher",), (0.1,), zs, "other weights") != path
    path.write_text("{broken")
    assert sc.read_model_record(path) is None  # unreadable: computed again
