"""The calibration-at-scale study's helpers (experiments.calibration_study) against dense float64 references."""
import pytest
import torch

from fisherkron.experiments import calibration_study as cs
from fisherkron.experiments.benchmark import kron_rel_error


def _spd(d: int, seed: int) -> torch.Tensor:
    X = torch.randn(d + 3, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X.T @ X / (d + 3)


@pytest.mark.parametrize("m,n", [(5, 3), (3, 6), (4, 4)])
def test_kron_rel_error_equals_the_dense_kronecker_difference(m, n):
    A0, B0 = _spd(m, 1), _spd(n, 2)
    A, B = A0 + 0.05 * _spd(m, 3), 1.7 * B0 - 0.1 * _spd(n, 4)  # a scale moved between the sides is no error
    ref = torch.linalg.norm(torch.kron(A, B) - torch.kron(A0, B0)) / torch.linalg.norm(torch.kron(A0, B0))
    assert kron_rel_error(A, B, A0, B0) == pytest.approx(float(ref), rel=1e-9)
    # the same Kronecker product written with the scale moved between its factors is no error at all
    assert kron_rel_error(3.0 * A0, B0 / 3.0, A0, B0) == pytest.approx(0.0, abs=1e-7)
    # float32 inputs are promoted: the result is the float64 one up to the inputs' rounding
    got32 = kron_rel_error(A.float(), B.float(), A0.float(), B0.float())
    assert got32 == pytest.approx(float(ref), rel=1e-4)


def test_product_flops_follow_the_granularity():
    class Stats:
        k, granularity = 4, "batch"
        layers = {"w": {"n": 6, "m": 5, "tokens": 40}}

    s = Stats()
    assert cs._product_flops(s, "w") == 2 * 4 * 6 * 5 * (6 + 5)  # k products G_i Z G_i^T
    s.granularity = "token"
    assert cs._product_flops(s, "w") == 2 * 40 * (6 * 6 + 5 * 5)  # D Z D^T row sums, then X^T diag X


def test_gradient_count_is_the_tokens_for_token_granularity():
    class Stats:
        k, granularity = 4, "batch"
        layers = {"a": {"tokens": 40}, "b": {"tokens": 40}}

    s = Stats()
    assert cs.gradient_count(s) == 4
    s.granularity = "sequence"  # stats.k already counts the sequences
    assert cs.gradient_count(s) == 4
    s.granularity = "token"  # stats.k counts the batches; every kept token is one gradient
    assert cs.gradient_count(s) == 40


def test_a_measurement_in_the_notebooks_process_says_so_and_is_never_served_to_an_isolated_study(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cs, "child", lambda spec: calls.append(("here", spec["k"])) or {"peak_gb": 1.0})
    monkeypatch.setattr(cs, "_run_child", lambda spec: calls.append(("child", spec["k"])) or {"peak_gb": 2.0})

    def study(isolate):
        return cs.Study("tiny", None, None, {"mff_tol": 1e-3}, {}, 8, tmp_path / "records.json", isolate=isolate)

    here = cs.measure(study(False), 2)
    assert here == {"peak_gb": 1.0, "isolated": False} and calls == [("here", 2)]
    # the isolated study measures again in a fresh process: the in-process record is keyed apart
    assert cs.measure(study(True), 2) == {"peak_gb": 2.0} and calls[-1] == ("child", 2)
    # and each is served from the cache afterwards
    assert cs.measure(study(True), 2) == {"peak_gb": 2.0} and cs.measure(study(False), 2)["isolated"] is False
    assert len(calls) == 2


def test_the_quality_cases_of_mff_methods_are_keyed_and_run_by_mff_dtype(tmp_path, monkeypatch):
    """float64 MFF reaches compress() for GFWSVD and keys its case apart; other methods keep their float32 keys."""
    import types

    import fisherkron.hf.surgery as surgery
    from fisherkron.core.conventions import FisherkronError

    seen = []

    def fake_compress(model, method, stats, *, mff_options, **kw):
        seen.append((method, mff_options))
        return types.SimpleNamespace(ratio=0.2, layers={})

    monkeypatch.setattr(surgery, "compress", fake_compress)
    monkeypatch.setattr(cs, "_score", lambda study, model: {"ppl_ptb": float(len(seen))})
    monkeypatch.setattr(cs, "gradient_count", lambda stats: 4)
    stats = types.SimpleNamespace(key="calib-key", granularity="batch")

    def study(dtype):
        return cs.Study("tiny", torch.nn.Linear(2, 2), None, {"mff_tol": 1e-3}, {}, 8, tmp_path / "r.json",
                        mff_dtype=dtype)

    for method in ("gfwsvd", "kfac_svd"):
        cs.run_case(study("float32"), stats, method, 0.2, k=4)
        cs.run_case(study("float64"), stats, method, 0.2, k=4)
    assert seen == [("gfwsvd", {"tol": 1e-3}), ("gfwsvd", {"tol": 1e-3, "dtype": torch.float64}),
                    ("kfac_svd", {"tol": 1e-3})]  # KFAC-SVD's float64 study read the float32 case
    cases = sorted(k for k in __import__("json").loads((tmp_path / "r.json").read_text()))
    assert cases == ["case|calib-key|gfwsvd|0.2000", "case|calib-key|gfwsvd|0.2000|mff-float64",
                     "case|calib-key|kfac_svd|0.2000"]
    with pytest.raises(FisherkronError, match="MFF computes in float32 or float64"):
        cs.prepare("no-such-model", mff_dtype="float16")  # before the model loads
