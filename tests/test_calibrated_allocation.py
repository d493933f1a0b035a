"""The calibrated allocation and the LEMS baseline: measured points, cache, budget, LEMS's formulas, CLI.

* the calibrated curve is Theorem 1's curve times one number and passes through its measured
  point (loss increase or KL divergence) for every layer;
* its measurements are the sensitivity sweep's (one evaluation per layer, PrefixReplay, the same
  cache): reused on a second call, measured again for other weights, held-out data or options,
  and for an entry edited by hand (a larger number, NaN, a string), which never reaches the ranks;
* the KL of :class:`OutputKL` equals a dense float64 reference, and replaying the prefix changes
  no KL;
* the budget is met as the fisher allocation meets it (within one rank step of one layer);
* LEMS's depth bias, tail-energy shape and candidate menu equal hand-computed values;
* options a strategy does not read, and bad values, are refused in one line; the CLI accepts
  ``--allocation calibrated`` / ``lems`` (and compresses with them end to end) and refuses bad
  combinations before loading the model.
"""
import copy
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import BertTokenizerFast

import fisherkron as fk
from fisherkron.cli import main
from fisherkron.core.allocation import depth_bias, energy_shape, scale_to_points
from fisherkron.core.lowrank import rank_for_ratio
from fisherkron.hf.allocation import LEMS, allocate, fisher_curves, lems_costs
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.sensitivity import OutputKL, PrefixReplay, loss_with_factors, sensitivity_sweep
from fisherkron.hf.surgery import compress, count_params
from fisherkron.testing import F64_REL
from cli_harness import loader, run_cli  # noqa: F401 (loader: a fixture)
from tiny_models import tiny_llama, token_batches

MFF = dict(max_matvecs=60)
#: a float32 loss of a tiny model, measured twice through different block paths (replayed or not)
REPLAY = 1e-6


def _batches(k=4, seed=0, B=2, T=10):
    return token_batches(k=k, seed=seed, B=B, T=T)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    return model, collect_calibration(model, _batches(), None, cache_dir=tmp_path_factory.mktemp("cal"))


def _allocate(model, st, strategy, tmp_path, held=None, method="gfwsvd", ratio=0.15, **kw):
    return allocate(model, method, st, list(st.layers), ratio=ratio, strategy=strategy,
                    heldout=_batches(k=2, seed=9) if held is None else held, cache_dir=tmp_path, mff_options=MFF, **kw)


# ---------------------------------------------------------------------------- the calibrated curve

def test_scale_to_points_passes_through_every_point_and_falls_back_for_no_increase():
    curves = {"a": np.array([8.0, 4.0, 1.0, 0.0]), "b": np.array([3.0, 2.0, 0.0]), "c": np.array([5.0, 1.0, 0.0]),
              "d": np.array([2.0, 0.0, 0.0])}
    points = {"a": (1, 2.0), "b": (1, 6.0), "c": (1, -0.1), "d": (1, 0.5)}  # c: a decrease; d: predicted 0
    scaled, k, fell = scale_to_points(curves, points)
    assert k["a"] == 0.5 and k["b"] == 3.0 and sorted(fell) == ["c", "d"]
    assert k["c"] == k["d"] == 0.5  # the smallest positive scale of the others
    for n in ("a", "b"):
        assert scaled[n][points[n][0]] == points[n][1]
        np.testing.assert_array_equal(scaled[n], k[n] * curves[n])  # the shape is Theorem 1's
    _, k, fell = scale_to_points({"a": curves["a"]}, {"a": (1, -1.0)})
    assert k == {"a": 1.0} and fell == ["a"]  # nothing measured an increase: the curve as predicted


@pytest.mark.parametrize("metric", ["kl", "loss"])
@pytest.mark.parametrize("method", ["gfwsvd", "svd_llm"])
def test_the_calibrated_curve_passes_through_its_measured_point_for_every_layer(metric, method, calibrated, tmp_path):
    base, st = calibrated
    names = list(st.layers)
    out = _allocate(base, st, "calibrated", tmp_path, method=method, calibrate_metric=metric)
    d = out.details
    assert set(d["points"]) == set(names) and d["calibrate_ratio"] == 0.5
    curves, _ = fisher_curves(base, method, st, names, mff_options=MFF)
    sweep = sensitivity_sweep(base, method, st, names, _batches(k=2, seed=9), ratios=(0.5,), cache_dir=tmp_path,
                              mff_options=MFF, metric=metric)
    assert sweep["from_cache"]  # the allocation's measurements are the sweep's, cached
    for n, (r, measured) in d["points"].items():
        assert r == rank_for_ratio(*base.get_submodule(n).weight.shape, 0.5)
        assert sweep["table"][n] == {r: measured}
        through = d["scales"][n] * float(curves[n][r])
        if n in d["fallback_scale"]:  # a measured decrease: the smallest positive scale of the others
            assert measured <= 0 and metric == "loss"
            assert d["scales"][n] == min(d["scales"][m] for m in names if m not in d["fallback_scale"])
        else:
            assert through == pytest.approx(measured, rel=F64_REL)
    if metric == "kl":
        assert not d["fallback_scale"] and all(v > 0 for _, v in d["points"].values())
        assert d["kl_temperature"] == 1.0
    # what the allocation predicts at its chosen ranks is the calibrated curve there
    for n, r in out.ranks.items():
        want = 0.0 if r is None else d["scales"][n] * float(curves[n][r])
        assert out.predicted[n] == pytest.approx(want, rel=F64_REL, abs=1e-300)


def test_the_calibrated_allocation_costs_one_evaluation_per_layer(calibrated, tmp_path):
    base, st = calibrated
    layers = len(st.layers)
    assert _allocate(base, st, "calibrated", tmp_path, calibrate_metric="loss").evaluations == layers + 1  # + dense
    assert _allocate(base, st, "calibrated", tmp_path).evaluations == layers + 2  # the KL, by default: + the outputs


def test_the_depth_term_multiplies_the_calibrated_curves(calibrated, tmp_path):
    base, st = calibrated
    flat = _allocate(base, st, "calibrated", tmp_path, calibrate_metric="kl")
    deep = _allocate(base, st, "calibrated", tmp_path, calibrate_metric="kl", depth_gamma=3.0)
    assert deep.details["from_cache"] and deep.details["depth_gamma"] == 3.0 and flat.details["depth_gamma"] == 0.0
    for n, r in deep.ranks.items():
        if r is not None:  # block 0 of 2 weighs 1 + 3, block 1 weighs 1
            block = int(n.split(".")[2])
            scale = flat.details["scales"][n] * (4.0 if block == 0 else 1.0)
            curves, _ = fisher_curves(base, "gfwsvd", st, [n], mff_options=MFF)
            assert deep.predicted[n] == pytest.approx(scale * float(curves[n][r]), rel=F64_REL)


# ---------------------------------------------------------------------------- the cache

@pytest.mark.parametrize("strategy", ["calibrated", "lems"])
def test_the_measurements_are_cached_and_invalidated_as_the_sweeps_are(strategy, calibrated, tmp_path):
    base, st = calibrated
    first = _allocate(base, st, strategy, tmp_path)
    again = _allocate(base, st, strategy, tmp_path)
    assert not first.details["from_cache"] and again.details["from_cache"]
    assert again.details["points"] == first.details["points"] and again.ranks == first.ranks
    assert again.evaluations == first.evaluations  # what the measurement cost, reported again
    other_data = _allocate(base, st, strategy, tmp_path, held=_batches(k=2, seed=10))
    assert not other_data.details["from_cache"]
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed.get_submodule("model.norm").weight.mul_(1.5)  # outside the compressed layers
    assert not _allocate(changed, st, strategy, tmp_path).details["from_cache"]  # other weights
    measured = {"calibrated": [{"calibrate_ratio": 0.3}, {"calibrate_metric": "loss"}, {"kl_temperature": 2.0}],
                "lems": [{"calibrate_ratio": 0.8}, {"kl_temperature": 2.0}]}[strategy]
    for opts in measured:  # options of the measurement
        assert not _allocate(base, st, strategy, tmp_path, **opts).details["from_cache"], opts
        assert _allocate(base, st, strategy, tmp_path, **opts).details["from_cache"], opts
    # options that change only the choice, not the measurement, read the cache
    assert _allocate(base, st, strategy, tmp_path, depth_gamma=1.0, solver="lagrangian").details["from_cache"]


def test_another_factorisation_is_measured_again(calibrated, tmp_path):
    base, st = calibrated
    one = _allocate(base, st, "calibrated", tmp_path, method="asvd")
    assert not _allocate(base, st, "calibrated", tmp_path, method="asvd", asvd_alpha=1.0).details["from_cache"]
    assert _allocate(base, st, "calibrated", tmp_path, method="asvd").details["points"] == one.details["points"]


@pytest.mark.parametrize("edit", ["larger", "nan", "string"])
@pytest.mark.parametrize("strategy", ["calibrated", "lems"])
def test_an_edited_measurement_is_measured_again_and_the_ranks_stay(strategy, edit, calibrated, tmp_path, caplog):
    """A hand-edited point in valid JSON would move the ranks; it is measured again, with a warning naming it."""
    base, st = calibrated
    first = _allocate(base, st, strategy, tmp_path)
    path = Path(first.details["cache"])
    size = {n: r if r is not None else math.inf for n, r in first.ranks.items()}
    # the edit that would move the ranks most: the most compressed layer made costly, the least made free
    name = (min if edit == "larger" else max)(first.details["points"], key=size.get)
    got = json.loads(path.read_text())
    row = got["layers"][name]["row"]
    (r,) = row
    row[r] = {"larger": 1e4 * abs(row[r]) + 1.0, "nan": math.nan, "string": "x"}[edit]
    path.write_text(json.dumps(got))
    with caplog.at_level(logging.WARNING, logger="fisherkron.hf.sensitivity"):
        again = _allocate(base, st, strategy, tmp_path)
    assert again.ranks == first.ranks and not again.details["from_cache"]
    assert again.details["points"][name] == pytest.approx(first.details["points"][name], rel=0, abs=1e-6)
    warned = [rec.getMessage() for rec in caplog.records if rec.name == "fisherkron.hf.sensitivity"]
    assert len(warned) == 1 and str(path) in warned[0] and f"entry '{name}'" in warned[0], warned


# ---------------------------------------------------------------------------- the KL

def test_output_kl_equals_a_dense_float64_reference_and_replay_changes_nothing(calibrated, monkeypatch):
    base, st = calibrated
    names = list(st.layers)
    held = _batches(k=2, seed=7)
    kl = OutputKL(base, held, temperature=0.6)
    assert abs(float(kl(base, held[0]))) <= 1e-12  # the dense model against itself: float64 round-off
    name = names[-1]
    f = fk.svd(base.get_submodule(name).weight.detach(), 2)
    replay = PrefixReplay(base, names, kl.batches, kl)
    assert replay.enabled and abs(replay.base) <= 1e-12
    fast = loss_with_factors(base, name, f, kl.batches, kl, replay=replay)
    slow = loss_with_factors(base, name, f, kl.batches, kl)
    assert fast == pytest.approx(slow, rel=REPLAY)
    model = copy.deepcopy(base)
    model.set_submodule(name, fk.LowRankLinear.from_factors(*f))
    want = []
    with torch.no_grad():
        for b in held:
            p = F.log_softmax(base(input_ids=b["input_ids"]).logits.double() / 0.6, -1).flatten(0, 1)
            q = F.log_softmax(model(input_ids=b["input_ids"]).logits.double() / 0.6, -1).flatten(0, 1)
            want.append(float(F.kl_div(q, p, log_target=True, reduction="batchmean")))  # mean over tokens
    assert slow == pytest.approx(sum(want) / len(want), rel=1e-5)  # float32 logits of two evaluations
    assert slow > 0
    monkeypatch.setattr(OutputKL, "CHUNK", 7)  # 20 outputs a batch: chunks of 7, 7 and 6
    assert loss_with_factors(base, name, f, kl.batches, kl) == pytest.approx(slow, rel=F64_REL)
    with pytest.raises(fk.FisherkronError, match="batches it was built on"):
        kl(base, _batches(k=1, seed=7)[0])  # an equal batch, but another object


def test_the_kl_sweep_refuses_a_loss_function_in_one_line(calibrated, tmp_path):
    base, st = calibrated
    with pytest.raises(fk.FisherkronError) as err:
        sensitivity_sweep(base, "svd", None, list(st.layers)[:1], _batches(k=1), ratios=(0.5,), metric="kl",
                          loss_fn=lambda m, b: m(**b).loss, cache_dir=tmp_path)
    assert "loss_fn and loss_name do not apply" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------- the budget

@pytest.mark.parametrize("strategy,options", [("calibrated", {}), ("calibrated", {"calibrate_metric": "kl"}),
                                              ("lems", {"rank_multiple": 1})])
@pytest.mark.parametrize("method", ["gfwsvd", "kfac_svd"])
def test_compress_meets_the_budget_as_the_fisher_allocation_does(strategy, options, method, calibrated, tmp_path):
    base, st = calibrated
    model = copy.deepcopy(base)
    rep = compress(model, method, st, ratio=0.15, allocation=strategy, mff_options=MFF,
                   allocation_options={"heldout": _batches(k=2, seed=9), "cache_dir": tmp_path, **options})
    assert rep.allocation == strategy and rep.ratio >= 0.15
    step = max(lr.n + lr.m for lr in rep.layers.values())
    assert rep.ratio < 0.15 + step / rep.params_before  # within one rank step of one layer
    assert count_params(model) == rep.params_after
    assert rep.allocation_cost["evaluations"] > 0
    dense = [n for n, lr in rep.layers.items() if lr.skipped]
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in dense)


@pytest.mark.parametrize("strategy", ["calibrated", "lems"])
def test_a_rank_grid_meets_the_budget(strategy, calibrated, tmp_path):
    base, st = calibrated
    out = _allocate(base, st, strategy, tmp_path, rank_multiple=2)
    assert out.ratio >= 0.15 and out.details["solver"] == "ilp" and out.details["optimal"]
    assert all(r is None or r % 2 == 0 for r in out.ranks.values())
    assert any(r is not None for r in out.ranks.values())


# ---------------------------------------------------------------------------- LEMS against hand-computed values

def test_lems_depth_bias_is_harmonicv2():
    # alpha = 0 (LEMS's configuration): H(b) = L - b, a line from 1 + gamma down to 1
    assert [depth_bias(b, 4, gamma=5.0) for b in range(4)] == pytest.approx([6.0, 1 + 10 / 3, 1 + 5 / 3, 1.0])
    # alpha = 1, L = 3: H = (1 + 1/2 + 1/3, 1/2 + 1/3, 1/3) = (11/6, 5/6, 1/3); (H(1) - 1/3) / (11/6 - 1/3) = 1/3
    assert depth_bias(1, 3, gamma=5.0, alpha=1.0) == pytest.approx(1 + 5 / 3)
    assert depth_bias(0, 3, gamma=2.0, alpha=1.0) == pytest.approx(3.0)
    assert depth_bias(0, 1, gamma=5.0) == 1.0  # one block: no bias (LEMS's 1e-12 floor of the range)
    with pytest.raises(fk.FisherkronError, match="gamma must be >= 0"):
        depth_bias(0, 2, gamma=-1.0)


def test_lems_shape_is_the_tail_energy_normalised_at_the_measured_rank():
    s = torch.tensor([3.0, 2.0, 1.0])  # s^2 = 9, 4, 1: tails 14, 5, 1, 0 of 14
    assert energy_shape(s, 1).tolist() == pytest.approx([14 / 5, 1.0, 1 / 5, 0.0])
    assert energy_shape(s, 2).tolist() == pytest.approx([14.0, 5.0, 1.0, 0.0])
    assert energy_shape(torch.tensor([1.0, 0.0]), 1).tolist() == pytest.approx([1e6, 0.0, 0.0])  # the 1e-6 floor


class _Dec:
    def __init__(self, S):
        self.S = S


def test_lems_costs_on_a_tiny_case():
    n, m = 40, 24  # r_eq = floor(960 / 64) = 15; 10 % of it: rank 1
    S = torch.linspace(3.0, 0.5, 24, dtype=torch.float64)
    r0 = rank_for_ratio(n, m, LEMS["calibrate_ratio"])
    assert r0 == 1
    costs = lems_costs({"x": _Dec(S)}, {"x": (n, m)}, {"x": (r0, 0.2)}, {"x": 3.0}, removed_share=0.2,
                       rank_multiple=1)["x"]
    tail = [float((S[r:] ** 2).sum() / (S ** 2).sum()) for r in range(25)]
    assert sorted(costs, key=lambda r: -1 if r is None else r) == [None, *range(5, 14)]  # 4.5 <= r < 14.25
    for r in range(5, 14):
        assert costs[r] == pytest.approx(3.0 * 0.2 * tail[r] / tail[r0], rel=F64_REL)
    assert costs[None] == 0.0
    wide = lems_costs({"x": _Dec(S)}, {"x": (n, m)}, {"x": (r0, 0.2)}, {"x": 3.0}, removed_share=0.6, rank_multiple=1)
    assert min(r for r in wide["x"] if r is not None) == 2  # beyond half removed: from 10 % of r_eq (1.5)
    eights = lems_costs({"x": _Dec(S)}, {"x": (n, m)}, {"x": (r0, 0.2)}, {"x": 3.0}, removed_share=0.2)
    assert set(eights["x"]) == {8, None}


@pytest.mark.parametrize("n,m", [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096)])
def test_lems_measured_rank_is_ten_percent_of_the_equal_size_rank(n, m):
    """Our per-layer ratio 0.9 is LEMS's ``int(0.1 * int(n m / (n + m)))``."""
    assert rank_for_ratio(n, m, LEMS["calibrate_ratio"]) == int(0.1 * int(n * m / (n + m)))


def test_the_lems_allocation_passes_through_its_kl_point_times_the_depth_bias(calibrated, tmp_path):
    base, st = calibrated
    out = _allocate(base, st, "lems", tmp_path, rank_multiple=1)
    d = out.details
    assert d["calibrate_metric"] == "kl" and d["kl_temperature"] == 0.6 and d["depth_gamma"] == 5.0
    for n, b in d["depth_bias"].items():
        assert b == (6.0 if ".layers.0." in n else 1.0)  # two blocks: 1 + 5, then 1
    for n, r in out.ranks.items():
        r0, kl = d["points"][n]
        assert r0 == rank_for_ratio(*base.get_submodule(n).weight.shape, 0.9) and kl > 0
        if r is not None:
            dec = fk.hf.allocation.Decompositions().get(base.get_submodule(n), "gfwsvd", st, n, mff_options=MFF)[0]
            want = d["depth_bias"][n] * kl * float(energy_shape(dec.S, r0)[r])
            assert out.predicted[n] == pytest.approx(want, rel=F64_REL)


# ---------------------------------------------------------------------------- one-line errors

@pytest.mark.parametrize("strategy,options,message", [
    ("fisher", {"calibrate_metric": "kl"}, "allocation 'fisher' does not read calibrate_metric"),
    ("sensitivity", {"solver": "ilp"}, "allocation 'sensitivity' does not read solver"),
    ("uniform", {"depth_gamma": 1.0}, "does not read depth_gamma; it applies to 'calibrated' and 'lems'"),
    ("calibrated", {"calibrate_metric": "loss", "kl_temperature": 0.5}, "kl_temperature applies to calibrate_metric='kl'"),
    ("calibrated", {"calibrate_metric": "mse"}, "calibrate_metric 'mse' is unknown"),
    ("calibrated", {"calibrate_ratio": 1.0}, "calibrate_ratio must be a per-layer ratio in (0, 1)"),
    ("calibrated", {"depth_gamma": -1.0}, "depth_gamma must be a number >= 0"),
    ("calibrated", {"rank_multiple": 0}, "rank_multiple must be an integer >= 1"),
    ("calibrated", {"solver": "cbc"}, "solver 'cbc' is unknown"),
    ("calibrated", {"solver": "lagrangian", "time_limit": 5}, "only solver='ilp' runs"),
    ("lems", {"calibrate_metric": "loss"}, "LEMS measures the KL divergence"),
    ("lems", {"kl_temperature": 0.0}, "kl_temperature must be a number > 0"),
])
def test_options_a_strategy_does_not_read_or_bad_values_are_one_line(strategy, options, message, calibrated):
    base, st = calibrated
    with pytest.raises(fk.FisherkronError) as err:
        if strategy == "uniform":  # compress plans a uniform ratio without allocate
            allocate(base, "gfwsvd", st, list(st.layers), ratio=0.1, strategy=strategy, **options)
        else:
            compress(copy.deepcopy(base), "gfwsvd", st, ratio=0.1, allocation=strategy,
                     allocation_options={"heldout": _batches(k=1), **options})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_calibrated_needs_statistics_and_held_out_batches(calibrated):
    base, st = calibrated
    with pytest.raises(fk.FisherkronError, match="calibration statistics"):
        compress(copy.deepcopy(base), "svd", None, ratio=0.1, allocation="calibrated",
                 allocation_options={"heldout": _batches(k=1)})
    with pytest.raises(fk.FisherkronError, match="held-out"):
        compress(copy.deepcopy(base), "gfwsvd", st, ratio=0.1, allocation="calibrated")
    with pytest.raises(fk.FisherkronError, match="held-out"):
        compress(copy.deepcopy(base), "svd", None, ratio=0.1, allocation="lems")


def test_lems_needs_no_statistics_for_svd(tmp_path):
    model = tiny_llama()
    out = allocate(model, "svd", None, [n for n, m in model.named_modules() if n.endswith("_proj")], ratio=0.1,
                   strategy="lems", heldout=_batches(k=1), cache_dir=tmp_path, rank_multiple=1)
    assert out.ratio >= 0.1 and out.details["optimal"]


# ---------------------------------------------------------------------------- the command line

_run = run_cli


@pytest.mark.parametrize("extra", [["--allocation", "calibrated"], ["--allocation", "lems"],
                                   ["--allocation", "calibrated", "--calibrate-metric", "kl",
                                    "--calibrate-ratio", "0.4"],
                                   ["--allocation", "lems", "--method", "svd", "--calibrate-ratio", "0.8"]])
def test_the_cli_accepts_calibrated_and_lems(extra, tmp_path, loader, capsys):
    code, err = _run(["compress", "smollm2", "--ratio", "0.2", "--out", tmp_path / "out", *extra], capsys)
    assert code == 130 and len(loader) == 1, err  # every check passed: the model was being loaded


@pytest.mark.parametrize("extra,message", [
    (["--allocation", "calibrated", "--method", "svd"], "method svd collects none"),
    (["--allocation", "lems", "--calibrate-metric", "kl"], "drop it for --allocation lems"),
    (["--allocation", "fisher", "--calibrate-ratio", "0.5"], "drop it for --allocation fisher"),
    (["--allocation", "calibrated", "--calibrate-ratio", "1.5"], "strictly between 0 and 1"),
    (["--allocation", "calibrated", "--calibrate-metric", "mse"], "invalid choice: 'mse'"),
], ids=["svd", "metric-lems", "ratio-fisher", "ratio-range", "metric-choice"])
def test_the_cli_refuses_bad_combinations_before_loading(extra, message, tmp_path, loader, capsys):
    code, err = _run(["compress", "smollm2", "--ratio", "0.2", "--out", tmp_path / "out", *extra], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert loader == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("allocation", ["calibrated", "lems"])
def test_the_cli_refuses_a_measured_allocation_for_a_classifier(allocation, tmp_path, loader, capsys):
    code, err = _run(["compress", "minilm", "--data", "sst2", "--ratio", "0.1", "--allocation", allocation,
                      "--out", tmp_path / "out"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "held-out C4 batches" in err, err
    assert loader == []


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random Llama saved with a character-level tokenizer (as tests/test_cli_robustness.py builds it)."""
    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(chars) + [f"##{c}" for c in chars]
             + list("0123456789") + list(".,'-$&?!<>"))  # 77 tokens: fits the tiny Llama's 97
    folder = tmp_path_factory.mktemp("models") / "llama"
    folder.mkdir()
    tiny_llama().save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), eos_token="[SEP]").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("extra", [["--allocation", "calibrated", "--calibrate-metric", "kl"],
                                   ["--allocation", "lems", "--method", "svd"]], ids=["calibrated", "lems"])
def test_the_cli_compresses_with_a_calibrated_or_lems_allocation(extra, llama_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    fast = ["--k", "2", "--batch-size", "2", "--seq-len", "16", "--no-cache"]
    code = main([str(a) for a in ["-q", "compress", llama_folder, "--out", tmp_path / "out", *fast, "--ratio", "0.2",
                                  *extra]])
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out)
    assert summary["allocation"] == extra[1] and summary["ratio"] >= 0.2


def test_output_kl_at_temperature_one_skips_the_division_and_changes_no_bit(calibrated, monkeypatch):
    base, st = calibrated
    name = list(st.layers)[-1]
    held = _batches(k=2, seed=7)
    f = fk.svd(base.get_submodule(name).weight.detach(), 2)
    fast = loss_with_factors(base, name, f, held, OutputKL(base, held))
    monkeypatch.setattr(OutputKL, "_scaled", lambda self, z: z.double() / self.temperature)  # the division kept
    assert loss_with_factors(base, name, f, held, OutputKL(base, held)) == fast > 0
