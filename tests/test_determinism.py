"""Determinism: the smoke profile run twice gives identical tables apart from timings.

Two fast smoke notebooks are each executed twice (papermill, as `make smoke` runs them, into
temporary folders with empty caches) and every table they write is compared with
:func:`fisherkron.repro.compare.compare_frames`, the comparison `make verify` uses, with every
column that is not declared ``timing`` required to be equal. The synthetic notebook trains MLPs
from seeds (accuracies, standard errors, Fisher shares); the runtime notebook runs MFF on
seeded synthetic gradients (Lanczos product counts, error estimates, FLOP counts). About 25 s
per notebook pair on 2 idle cores (the two runs of a notebook go side by side).
"""
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from fisherkron.repro import verify
from fisherkron.repro.execute import execute

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["fig_synthetic_correlations", "fig_time_algo"]


def _run(name: str, out: Path) -> Path:
    env = dict(os.environ, FISHERKRON_DATA=str(out / "data"))
    ok, _, _ = execute(name, out / "figures", out / "notebooks", env=env, profile="smoke", root=ROOT,
                       log=out / f"{name}.log")
    assert ok, (out / f"{name}.log").read_text()[-3000:]
    return out / "figures"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_smoke_notebook_twice_gives_identical_tables_apart_from_timings(name, tmp_path):
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda d: _run(name, tmp_path / d), ["first", "second"])
    tables = verify.tables_of(first, name)
    assert tables and tables == verify.tables_of(second, name)
    for table in tables:
        declared, source = verify.declared_tolerances(table, first)
        assert source == "provenance"  # the notebook declares its tables' tolerances
        rep = verify.compare_frames(table, pd.read_csv(first / f"{table}.csv"), pd.read_csv(second / f"{table}.csv"),
                                    declared, identical=True)
        assert not rep.defaults, f"{table}: columns without a declared tolerance: {sorted(rep.defaults)}"
        assert rep.columns > 0 and rep.status == "PASS", "\n".join(f.line() for f in rep.failures)


def test_make_test_leaves_out_of_its_smoke_run_exactly_the_notebooks_run_here():
    """`make test` skips SMOKE_TWICE (mk/smoke.mk) in its smoke run because this file executes them twice."""
    line = next(l for l in (ROOT / "mk" / "smoke.mk").read_text().splitlines() if l.startswith("SMOKE_TWICE :="))
    assert sorted(line.split(":=", 1)[1].split()) == sorted(NOTEBOOKS)
