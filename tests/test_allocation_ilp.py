"""The rank choice as a multiple-choice knapsack: the integer program (HiGHS) and the Lagrangian against brute force.

* ``knapsack(solver="ilp")`` finds the optimum of small instances found by enumeration, meets the
  budget, handles ties and a zero budget, and refuses an unreachable budget in one line;
* the Lagrangian's dual bound is a valid lower bound and its certified gap covers its distance
  to the optimum (``choose_ranks(info=)`` and ``knapsack(solver="lagrangian")``);
* when HiGHS proves nothing within its time limit, a warning gives the MIP gap and the
  Lagrangian's ranks (or HiGHS's better incumbent) are used;
* the 210-layer SmolLM2-shaped instance with ~20 candidates per layer is solved to optimality.
"""
import itertools
import logging
import math

import numpy as np
import pytest
import torch
from scipy.optimize import OptimizeResult

import fisherkron as fk
from fisherkron.core import allocation as core
from fisherkron.core.allocation import (ILP_REL_GAP, choose_ranks, curve_costs, knapsack, max_profitable_rank, saving,
                                        truncation_errors)
from fisherkron.core.lowrank import rank_for_ratio

#: HiGHS stops at a relative gap of ILP_REL_GAP: an "optimal" cost is within it of the enumerated optimum
OPT = ILP_REL_GAP
#: sums of a few float64 costs in another order
ROUND = 1e-12


def _brute_force(costs, shapes, need):
    """``(least cost, its removal)`` over every choice of one option per layer that removes ``need``; None if none."""
    menus = {n: [r for r in list(c) + [None] if r is None or saving(*shapes[n], r) > 0] for n, c in costs.items()}
    best = None
    for combo in itertools.product(*(dict.fromkeys(v) for v in menus.values())):
        ch = dict(zip(menus, combo))
        removed = sum(saving(*shapes[n], r) for n, r in ch.items())
        if removed < need:
            continue
        cost = sum(costs[n].get(r, 0.0) for n, r in ch.items())
        if best is None or cost < best[0] - ROUND * abs(cost):
            best = (cost, removed)
    return best


def _instance(seed, layers=4, monotone=True):
    """Random menus on odd shapes: a few candidate ranks per layer with positive costs (monotone or not)."""
    rng = np.random.default_rng(seed)
    shapes, costs = {}, {}
    for i in range(layers):
        n, m = int(rng.integers(5, 14)), int(rng.integers(4, 11))
        rmax = max_profitable_rank(n, m)
        ranks = sorted(rng.choice(np.arange(1, rmax + 1), size=min(rmax, int(rng.integers(2, 5))), replace=False))
        c = np.sort(rng.random(len(ranks)) * 10 ** rng.uniform(-3, 1))[::-1] if monotone else rng.random(len(ranks))
        shapes[f"l{i}"] = (n, m)
        costs[f"l{i}"] = {int(r): float(v) for r, v in zip(ranks, c)}
    return costs, shapes


def _removed(choice, shapes):
    return sum(saving(*shapes[n], r) for n, r in choice.ranks.items())


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("monotone", [True, False], ids=["monotone", "non-monotone"])
def test_ilp_finds_the_enumerated_optimum_and_meets_the_budget(seed, monotone):
    costs, shapes = _instance(seed, monotone=monotone)
    most = sum(max(saving(*shapes[n], r) for r in c) for n, c in costs.items())
    for frac in (0.1, 0.4, 0.7, 0.95):
        need = int(frac * most)
        want, _ = _brute_force(costs, shapes, need)
        got = knapsack(costs, shapes, need)
        assert got.solver == "ilp" and got.optimal
        assert got.removed == _removed(got, shapes) >= need
        assert got.cost == pytest.approx(sum(costs[n].get(r, 0.0) for n, r in got.ranks.items()), rel=ROUND)
        assert got.cost <= want + OPT * abs(want) + ROUND, (frac, got.ranks)
        assert got.bound <= want + OPT * abs(want) + ROUND  # HiGHS's dual bound is a lower bound
        lag = knapsack(costs, shapes, need, solver="lagrangian")
        assert lag.removed >= need and not lag.optimal
        assert lag.bound <= want + ROUND * abs(want)  # weak duality: D(lambda) never exceeds the optimum
        assert lag.cost - want <= lag.gap + ROUND * abs(want)  # the certified gap covers the true one


@pytest.mark.parametrize("seed", range(4))
def test_ilp_over_every_rank_of_theorem1_curves_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (9, 7), "b": (8, 8), "c": (12, 5)}
    curves = {n: truncation_errors(torch.randn(*s, generator=g, dtype=torch.float64)
                                   * (1 + 3 * torch.rand(1, generator=g).item())) for n, s in shapes.items()}
    costs = curve_costs(curves, shapes)
    total = sum(n * m for n, m in shapes.values())
    for frac in (0.1, 0.3, 0.5):
        need = int(frac * total)
        want, _ = _brute_force(costs, shapes, need)
        got = knapsack(costs, shapes, need)
        assert got.optimal and got.removed >= need
        assert got.cost <= want * (1 + OPT) + ROUND
        info = {}
        ranks = choose_ranks(curves, shapes, need, info=info)  # the Lagrangian of the fisher allocation
        cost = sum(0.0 if r is None else float(curves[n][r]) for n, r in ranks.items())
        assert info["cost"] == pytest.approx(cost, rel=ROUND)
        assert info["bound"] <= want * (1 + ROUND) and info["gap"] == pytest.approx(cost - info["bound"], rel=ROUND)
        assert cost - want <= info["gap"] + ROUND * want


def test_ties_give_the_optimum_with_the_budget_met_as_tightly_as_the_options_allow():
    """Equal layers and equal costs: the optimum's cost, and of the equal-cost choices one that removes least."""
    shapes = {n: (10, 10) for n in "abcd"}  # saving(10, 10, r) = 100 - 20 r: 80, 60, 40, 20
    costs = {n: {1: 3.0, 2: 2.0, 3: 1.0, 4: 1.0} for n in shapes}  # ranks 3 and 4 cost the same
    for solver in ("ilp", "lagrangian"):
        two = knapsack(costs, shapes, 80, solver=solver)  # the one optimum (up to the layers): two at rank 3
        assert two.cost == 2.0 and two.removed == 80
        assert sorted(two.ranks.values(), key=str) == [3, 3, None, None]
        tight = knapsack(costs, shapes, 60, solver=solver)  # rank 2, 3 + 3 or 3 + 4 all cost 2; 3 + 3 removes 80
        assert tight.cost == 2.0 and tight.removed == 60, tight.ranks
    flat = {n: {1: 0.0, 2: 0.0, 3: 0.0} for n in shapes}  # every choice costs 0
    got = knapsack(flat, shapes, 60)
    assert got.cost == 0.0 and got.removed == 60


def test_a_zero_budget_keeps_every_layer_dense():
    costs, shapes = _instance(0)
    got = knapsack(costs, shapes, 0)
    assert set(got.ranks.values()) == {None} and got.cost == 0.0 and got.removed == 0


@pytest.mark.parametrize("solver", ["ilp", "lagrangian"])
def test_an_unreachable_budget_is_refused_in_one_line(solver):
    costs, shapes = _instance(1)
    most = sum(max(saving(*shapes[n], r) for r in c) for n, c in costs.items())
    with pytest.raises(fk.FisherkronError) as err:
        knapsack(costs, shapes, most + 1, solver=solver)
    msg = str(err.value)
    assert "\n" not in msg and f"{most:,}" in msg and "smaller ratio" in msg


@pytest.mark.parametrize("kwargs,message", [
    ({"solver": "gurobi"}, "solver 'gurobi' is unknown"),
    ({"time_limit": 0}, "time_limit must be"),
    ({"time_limit": True}, "time_limit must be"),
])
def test_bad_solver_options_are_one_line(kwargs, message):
    costs, shapes = _instance(2)
    with pytest.raises(fk.FisherkronError, match=message) as err:
        knapsack(costs, shapes, 10, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_candidates_are_one_line():
    shapes = {"a": (5, 4)}
    for bad in ({0: 1.0}, {5: 1.0}, {2.5: 1.0}):
        with pytest.raises(fk.FisherkronError, match="candidate rank .* of layer a"):
            knapsack({"a": bad}, shapes, 1)
    with pytest.raises(fk.FisherkronError, match="not all finite"):
        knapsack({"a": {1: float("nan")}}, shapes, 1)


def _highs_gives_up(monkeypatch, x=None):
    """Make HiGHS stop at its time limit, with no solution or with the solution ``x`` (status 1)."""
    def fake(c, **kwargs):
        return OptimizeResult(status=1, x=None if x is None else x(len(c)), mip_gap=0.25, mip_dual_bound=-np.inf,
                              message="Time limit reached")
    monkeypatch.setattr(core, "milp", fake)


def test_without_a_proof_in_time_the_lagrangian_is_used_with_a_warning(monkeypatch, caplog):
    costs, shapes = _instance(3, layers=6)
    most = sum(max(saving(*shapes[n], r) for r in c) for n, c in costs.items())
    need = int(0.6 * most)
    lag = knapsack(costs, shapes, need, solver="lagrangian")
    _highs_gives_up(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fisherkron.core.allocation"):
        got = knapsack(costs, shapes, need, time_limit=5)
    assert got.solver == "lagrangian" and not got.optimal and got.ranks == lag.ranks and got.removed >= need
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "did not prove the rank choice optimal within 5 s" in warned[0]
    assert "Lagrangian" in warned[0] and f"{got.gap:.3g}" in warned[0]


def test_highs_incumbent_is_kept_where_it_beats_the_lagrangian(monkeypatch, caplog):
    """An incumbent that is cheaper than the Lagrangian's choice is used, and the MIP gap is reported."""
    costs, shapes = _instance(3, layers=6)
    most = sum(max(saving(*shapes[n], r) for r in c) for n, c in costs.items())
    need = int(0.6 * most)
    exact = knapsack(costs, shapes, need)
    lag = knapsack(costs, shapes, need, solver="lagrangian")
    if exact.cost >= lag.cost:
        pytest.skip("the Lagrangian is optimal on this instance")
    real = core.milp

    def incumbent(c, **kwargs):
        res = real(c, **kwargs)
        return OptimizeResult(status=1, x=res.x, mip_gap=0.25, mip_dual_bound=res.mip_dual_bound)
    monkeypatch.setattr(core, "milp", incumbent)
    with caplog.at_level(logging.WARNING, logger="fisherkron.core.allocation"):
        got = knapsack(costs, shapes, need)
    assert got.solver == "ilp" and not got.optimal and got.cost == pytest.approx(exact.cost, rel=ROUND)
    assert "MIP gap 2.50e-01" in caplog.records[0].getMessage() and "HiGHS's best" in caplog.records[0].getMessage()


def _smollm2_instance(seed=0):
    """30 blocks x 7 SmolLM2-135M layers; Theorem-1-like tails of random decaying spectra on many scales."""
    rng = np.random.default_rng(seed)
    block = [("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576), ("gate", 1536, 576),
             ("up", 1536, 576), ("down", 576, 1536)]
    shapes, curves = {}, {}
    for b in range(30):
        for nm, n, m in block:
            q = min(n, m)
            s2 = np.sort(rng.lognormal(0, 1.5, q) * np.arange(1, q + 1) ** -rng.uniform(0.3, 1.2))[::-1] ** 2
            shapes[f"{b}.{nm}"] = (n, m)
            curves[f"{b}.{nm}"] = np.concatenate([np.cumsum(s2[::-1])[::-1], [0.0]]) * 10 ** rng.uniform(-4, 1)
    return curves, shapes


def test_the_210_layer_instance_with_20_candidates_is_solved_to_optimality():
    curves, shapes = _smollm2_instance()
    grid = {n: [rank_for_ratio(*shapes[n], rho) for rho in np.arange(0.05, 0.96, 0.05)] for n in shapes}
    costs = curve_costs(curves, shapes, grid)
    assert np.mean([len(c) for c in costs.values()]) == 20  # 19 ranks and dense
    need = math.ceil(0.1 * 134_515_008)  # 10 % of SmolLM2-135M
    got = knapsack(costs, shapes, need)
    lag = knapsack(costs, shapes, need, solver="lagrangian")
    assert got.optimal and got.removed >= need
    assert got.cost <= lag.cost and lag.bound <= got.cost * (1 + ROUND)
    assert got.gap <= OPT * got.cost
